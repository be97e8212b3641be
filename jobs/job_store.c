/*
 * job_store.c - the job table's queries: batch-predict jobs, their committed
 * progress, and the leases by which replicas sharing a store run each job
 * once. The table lives in the store's index (SQLite or PostgreSQL behind
 * checkpoint/index_impl.h; its schema is with the others in the backends'
 * migration lists), so this file uses the store's private header; nothing
 * else outside checkpoint/ may. Its SQL is written once, for both engines.
 */
#include "jobs.h"

#include <stdlib.h>
#include <string.h>

#include "../checkpoint/store_internal.h"

#define JOB_COLS                                                                              \
    "id, model, version, spec, status, rows_done, rows_total, rows_skipped, output_path, "   \
    "output_bytes, correct, labeled, confusion, rows_per_s, partial, error, created_at, "    \
    "started_at, finished_at, updated_at, owner, files_skipped, accuracy_note, chunks_total "

static json_t *col_or_null(md_ixstmt *st, int i)
{
    switch (ix_column_type(st, i)) {
    case MD_IXT_NULL:
        return json_null();
    case MD_IXT_INT:
        return json_integer(ix_column_int64(st, i));
    case MD_IXT_FLOAT:
        return json_real(ix_column_double(st, i));
    default:
        return json_string(ix_column_text(st, i));
    }
}

static json_t *job_json(md_ixstmt *st)
{
    static const char *names[] = {"id", "model", "version", "spec", "status", "rows_done",
                                  "rows_total", "rows_skipped", "output_path", "output_bytes",
                                  "correct", "labeled", "confusion", "rows_per_s", "partial",
                                  "error", "created_at", "started_at", "finished_at",
                                  "updated_at", "owner", "files_skipped", "accuracy_note",
                                  "chunks_total"};
    json_t *j = json_object();
    for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++) {
        if (i == 3 || i == 12) {
            json_object_set_new(j, names[i], ix_column_type(st, i) == MD_IXT_NULL
                                                 ? json_null()
                                                 : json_col(st, i));
        } else if (i == 14) {
            json_object_set_new(j, names[i], json_boolean((int)ix_column_int64(st, i)));
        } else {
            json_object_set_new(j, names[i], col_or_null(st, i));
        }
    }
    return j;
}

md_status md_store_job_create(md_store *s, const char *id, const char *model, int version,
                              json_t *spec, const char *output_path, md_err *err)
{
    char *text = json_dumps(spec, JSON_COMPACT);
    char now[32];
    now_iso(now);
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s,
                            "INSERT INTO jobs (id, model, version, spec, status, output_path, "
                            "created_at, updated_at) VALUES (?,?,?,?, 'queued', ?, ?, ?)",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    ix_bind_text(st, 1, id);
    ix_bind_text(st, 2, model);
    if (version)
        ix_bind_int64(st, 3, version);
    else
        ix_bind_null(st, 3);
    ix_bind_text(st, 4, text);
    ix_bind_text(st, 5, output_path);
    ix_bind_text(st, 6, now);
    ix_bind_text(st, 7, now);
    if (ix_step(st) != MD_IX_DONE)
        rc = db_fail(s, err, "insert job");
    ix_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    free(text);
    return rc;
}

/* A chunked job's progress: "chunks": {total, done, running, pending,
 * holders: the owners of its running chunks}. The lock held. */
static void chunk_summary(md_store *s, const char *id, json_t *job)
{
    md_err err;
    md_ixstmt *st = prep(s, "SELECT status, owner, count(*) FROM job_chunks WHERE job_id = ?1 "
                            "GROUP BY status, owner ORDER BY status, owner", &err);
    if (!st)
        return;
    ix_bind_text(st, 1, id);
    long long done = 0, running = 0, pending = 0;
    json_t *holders = json_array();
    /* an ended job runs nothing: a chunk a runner still held when it was
     * cancelled (its finish is refused) is not done, not running */
    const char *js = json_string_value(json_object_get(job, "status"));
    int ended = js && strcmp(js, "queued") != 0 && strcmp(js, "running") != 0;
    while (ix_step(st) == MD_IX_ROW) {
        const char *status = ix_column_text(st, 0);
        const char *owner = ix_column_text(st, 1);
        long long n = ix_column_int64(st, 2);
        if (status && !strcmp(status, "done"))
            done += n;
        else if (status && !strcmp(status, "running") && !ended) {
            running += n;
            if (owner)
                json_array_append_new(holders, json_string(owner));
        } else
            pending += n;
    }
    ix_finalize(st);
    json_object_set_new(job, "chunks",
                        json_pack("{s:I,s:I,s:I,s:I,s:o}", "total",
                                  (json_int_t)json_integer_value(json_object_get(job, "chunks_total")),
                                  "done", (json_int_t)done, "running", (json_int_t)running,
                                  "pending", (json_int_t)pending, "holders", holders));
}

md_status md_store_job_get(md_store *s, const char *id, json_t **out, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s, "SELECT " JOB_COLS "FROM jobs WHERE id = ?", err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    ix_bind_text(st, 1, id);
    int step = ix_step(st);
    if (step == MD_IX_ROW) {
        *out = job_json(st);
        if (json_integer_value(json_object_get(*out, "chunks_total")) > 0)
            chunk_summary(s, id, *out);
    }
    else if (step == MD_IX_ERROR) /* not a 404: the index could not answer */
        rc = db_fail(s, err, "read the job");
    else
        rc = md_err_setc(err, MD_ENOTFOUND, "job_not_found",
                         "job %s does not exist; GET /jobs lists the jobs", id);
    ix_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_job_list(md_store *s, const char *status, const char *model,
                            const char *before, int limit, json_t **out, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s,
                            "SELECT " JOB_COLS "FROM jobs WHERE (?1 IS NULL OR status = ?1) AND "
                            "(?2 IS NULL OR model = ?2) AND (?3 IS NULL OR id < ?3) "
                            "ORDER BY id DESC LIMIT ?4",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    if (status)
        ix_bind_text(st, 1, status);
    if (model)
        ix_bind_text(st, 2, model);
    if (before)
        ix_bind_text(st, 3, before);
    ix_bind_int64(st, 4, limit + 1);
    json_t *jobs = json_array();
    json_t *next = json_null();
    int n = 0, step;
    while ((step = ix_step(st)) == MD_IX_ROW) {
        if (n++ == limit) {
            next = json_incref(json_object_get(json_array_get(jobs, (size_t)limit - 1), "id"));
            break;
        }
        json_array_append_new(jobs, job_json(st));
    }
    ix_finalize(st);
    if (step == MD_IX_ERROR) { /* not a shorter list: the index failed */
        rc = db_fail(s, err, "list jobs");
        json_decref(jobs);
        json_decref(next);
        goto out;
    }
    *out = json_pack("{s:o,s:o}", "jobs", jobs, "next", next);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* Now, in seconds since the epoch, on the index's clock: leases are
 * compared by every replica sharing it, so they are read and written on
 * one clock (PostgreSQL's), never on each host's. SQLite serves one host. */
static const char *db_now_sql(md_store *s)
{
    return md_store_jobs_chunked(s) ? "extract(epoch from clock_timestamp())"
                                    : "((julianday('now') - 2440587.5) * 86400.0)";
}

/* Now as an ISO time (like md_now_iso: 2026-01-31T12:00:00.000Z) on the
 * index's clock: removals are stamped with it, so every replica reads them
 * from a watermark on that one clock, whatever its own says. */
static const char *db_iso_now_sql(md_store *s)
{
    return md_store_jobs_chunked(s)
               ? "to_char(clock_timestamp() AT TIME ZONE 'UTC', "
                 "'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"
               : "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";
}

md_status md_store_db_now_iso(md_store *s, char out[32], md_err *err)
{
    char sql[160];
    snprintf(sql, sizeof sql, "SELECT %s", db_iso_now_sql(s));
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s, sql, err);
    if (!st)
        rc = MD_EIO;
    else if (ix_step(st) != MD_IX_ROW || !ix_column_text(st, 0))
        rc = db_fail(s, err, "read the index's clock");
    else
        snprintf(out, 32, "%s", ix_column_text(st, 0));
    ix_finalize(st);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* UPDATE the columns named by `fields`; with `owner`, only while that owner
 * holds the job, extending its lease to now + lease_s (0 rows: ECONFLICT). */
static md_status job_update(md_store *s, const char *id, const char *owner, double lease_s,
                            json_t *fields, int *cancel_requested, md_err *err)
{
    static const char *allowed[] = {"status", "rows_done", "rows_total", "rows_skipped",
                                    "output_bytes", "correct", "labeled", "confusion",
                                    "rows_per_s", "partial", "error", "started_at",
                                    "finished_at", "version", "spec", "files_skipped",
                                    "accuracy_note", NULL};
    char sql[1200];
    size_t n = (size_t)snprintf(sql, sizeof sql, "UPDATE jobs SET updated_at = ?1");
    const char *key;
    json_t *v;
    int idx = 2;
    json_object_foreach(fields, key, v)
    {
        int ok = 0;
        for (int i = 0; allowed[i]; i++)
            ok |= strcmp(key, allowed[i]) == 0;
        md_assert(ok);
        n += (size_t)snprintf(sql + n, sizeof sql - n, ", %s = ?%d", key, idx++);
    }
    int id_idx = idx++;
    if (owner) {
        n += (size_t)snprintf(sql + n, sizeof sql - n, ", lease_until = %s + ?%d WHERE id = ?%d "
                              "AND owner = ?%d RETURNING cancel_requested", db_now_sql(s), idx,
                              id_idx, idx + 1);
    } else {
        snprintf(sql + n, sizeof sql - n, " WHERE id = ?%d", id_idx);
    }
    char now[32];
    now_iso(now);
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s, sql, err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    ix_bind_text(st, 1, now);
    idx = 2;
    json_object_foreach(fields, key, v)
    {
        if (json_is_integer(v))
            ix_bind_int64(st, idx, json_integer_value(v));
        else if (json_is_real(v))
            ix_bind_double(st, idx, json_real_value(v));
        else if (json_is_string(v))
            ix_bind_text(st, idx, json_string_value(v));
        else if (json_is_boolean(v))
            ix_bind_int64(st, idx, json_is_true(v));
        else if (json_is_null(v))
            ix_bind_null(st, idx);
        else {
            char *t = json_dumps(v, JSON_COMPACT);
            ix_bind_text(st, idx, t);
            free(t);
        }
        idx++;
    }
    ix_bind_text(st, id_idx, id);
    if (owner) {
        ix_bind_double(st, id_idx + 1, lease_s);
        ix_bind_text(st, id_idx + 2, owner);
        int r = ix_step(st);
        if (r == MD_IX_ROW) {
            if (cancel_requested)
                *cancel_requested = (int)ix_column_int64(st, 0);
            r = ix_step(st);
        } else if (r == MD_IX_DONE) {
            rc = md_err_setc(err, MD_ECONFLICT, "job_lease_lost",
                             "job %s is no longer held by this process (%s)", id, owner);
        }
        if (rc == MD_OK && r != MD_IX_DONE)
            rc = db_fail(s, err, "update job");
    } else if (ix_step(st) != MD_IX_DONE) {
        rc = db_fail(s, err, "update job");
    }
    ix_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_job_update(md_store *s, const char *id, json_t *fields, md_err *err)
{
    return job_update(s, id, NULL, 0, fields, NULL, err);
}

md_status md_store_job_update_owned(md_store *s, const char *id, const char *owner,
                                    double lease_s, json_t *fields, int *cancel_requested,
                                    md_err *err)
{
    json_t *empty = fields ? NULL : json_object();
    md_status rc = job_update(s, id, owner, lease_s, fields ? fields : empty, cancel_requested,
                              err);
    json_decref(empty);
    return rc;
}

md_status md_store_job_claim_next(md_store *s, const char *owner, double lease_s,
                                  int (*owner_dead)(const char *owner, void *ctx), void *ctx,
                                  char id[64], md_err *err)
{
    id[0] = '\0';
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    char sel_sql[400], upd_sql[400];
    snprintf(sel_sql, sizeof sel_sql,
             "SELECT id, owner, lease_until, %s FROM jobs WHERE status IN "
             "('queued','running') AND (owner IS NULL OR owner != ?1) ORDER BY created_at, id",
             db_now_sql(s));
    snprintf(upd_sql, sizeof upd_sql,
             "UPDATE jobs SET owner = ?1, lease_until = %s + ?2 WHERE id = ?3 AND "
             "status IN ('queued','running') AND (owner = ?4 OR (owner IS NULL AND ?4 IS NULL))",
             db_now_sql(s));
    md_ixstmt *sel = prep(s, sel_sql, err);
    md_ixstmt *upd = prep(s, upd_sql, err);
    if (!sel || !upd) {
        rc = MD_EIO;
        goto out;
    }
    ix_bind_text(sel, 1, owner);
    int r;
    while ((r = ix_step(sel)) == MD_IX_ROW) {
        const char *cand = ix_column_text(sel, 0);
        const char *held = ix_column_text(sel, 1);
        double until = ix_column_double(sel, 2), now = ix_column_double(sel, 3);
        if (held && until >= now && !(owner_dead && owner_dead(held, ctx)))
            continue; /* a live lease */
        ix_reset(upd);
        ix_bind_text(upd, 1, owner);
        ix_bind_double(upd, 2, lease_s);
        ix_bind_text(upd, 3, cand);
        if (held)
            ix_bind_text(upd, 4, held);
        else
            ix_bind_null(upd, 4);
        if (ix_step(upd) != MD_IX_DONE) {
            rc = db_fail(s, err, "claim job");
            break;
        }
        if (ix_changes(s->ix) == 1) { /* another process may have taken it first */
            snprintf(id, 64, "%s", cand);
            break;
        }
    }
    if (rc == MD_OK && r != MD_IX_ROW && r != MD_IX_DONE)
        rc = db_fail(s, err, "list claimable jobs");
out:
    ix_finalize(sel);
    ix_finalize(upd);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* Run `sql` with text parameters ?1 and ?2, the lock held; *changes (may be
 * NULL) gets the number of rows it changed. */
static md_status exec2(md_store *s, const char *sql, const char *p1, const char *p2,
                       const char *what, int *changes, md_err *err)
{
    md_ixstmt *st = prep(s, sql, err);
    if (!st)
        return MD_EIO;
    ix_bind_text(st, 1, p1);
    ix_bind_text(st, 2, p2);
    md_status rc = MD_OK;
    if (ix_step(st) != MD_IX_DONE)
        rc = db_fail(s, err, what);
    else if (changes)
        *changes = ix_changes(s->ix);
    ix_finalize(st);
    return rc;
}

md_status md_store_job_release(md_store *s, const char *id, const char *owner, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = exec2(s,
                         "UPDATE jobs SET owner = NULL, lease_until = NULL WHERE id = ?1 AND "
                         "owner = ?2",
                         id, owner, "release job", NULL, err);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_job_request_cancel(md_store *s, const char *id, int *cancelled_now,
                                      md_err *err)
{
    char now[32];
    now_iso(now);
    int changed = 0;
    pthread_mutex_lock(&s->mu);
    /* a queued job nobody holds is cancelled at once; any other is flagged
     * for its holder (or whoever claims it next) */
    md_status rc = exec2(s,
                         "UPDATE jobs SET status = 'cancelled', finished_at = ?2, "
                         "updated_at = ?2 WHERE id = ?1 AND status = 'queued' AND owner IS NULL",
                         id, now, "cancel job", &changed, err);
    if (rc == MD_OK && changed != 1)
        rc = exec2(s,
                   "UPDATE jobs SET cancel_requested = 1, updated_at = ?2 WHERE id = ?1 AND "
                   "status IN ('queued','running')",
                   id, now, "cancel job", NULL, err);
    pthread_mutex_unlock(&s->mu);
    *cancelled_now = rc == MD_OK && changed == 1;
    return rc;
}

/* ---- removing ended jobs (job_retention.c) ---- */

/* Run `sql` with the text parameter ?1, the lock held; *changes (may be
 * NULL) gets the number of rows it changed. */
static md_status exec1(md_store *s, const char *sql, const char *p1, const char *what,
                       int *changes, md_err *err)
{
    md_ixstmt *st = prep(s, sql, err);
    if (!st)
        return MD_EIO;
    ix_bind_text(st, 1, p1);
    md_status rc = ix_step(st) == MD_IX_DONE ? MD_OK : db_fail(s, err, what);
    if (rc == MD_OK && changes)
        *changes = ix_changes(s->ix);
    ix_finalize(st);
    return rc;
}

#define ENDED "('succeeded','failed','cancelled')"

/* The rows of `sql` (text ?1 = p1, ?2 = limit) as a new array, each made
 * by row(); `what` names the query in an error. Takes the lock. */
static md_status select_rows(md_store *s, const char *sql, const char *p1, int limit,
                             json_t *(*row)(md_ixstmt *st), const char *what, json_t **out,
                             md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s, sql, err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    ix_bind_text(st, 1, p1);
    ix_bind_int64(st, 2, limit);
    json_t *rows = json_array();
    int step;
    while ((step = ix_step(st)) == MD_IX_ROW)
        json_array_append_new(rows, row(st));
    ix_finalize(st);
    if (step == MD_IX_ERROR) {
        rc = db_fail(s, err, what);
        json_decref(rows);
        goto out;
    }
    *out = rows;
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static json_t *row_id(md_ixstmt *st) { return json_string(ix_column_text(st, 0)); }

static json_t *row_id_spec(md_ixstmt *st)
{
    return json_pack("[s,o]", ix_column_text(st, 0), json_col(st, 1));
}

static json_t *row_id_text(md_ixstmt *st)
{
    return json_pack("[s,s]", ix_column_text(st, 0), ix_column_text(st, 1));
}

md_status md_store_jobs_ended_before(md_store *s, const char *before, int limit, json_t **out,
                                     md_err *err)
{
    char sql[512];
    snprintf(sql, sizeof sql,
             "SELECT id FROM jobs WHERE status IN " ENDED " AND "
             "COALESCE(finished_at, updated_at) < ?1 AND "
             "(removing_until IS NULL OR removing_until < %s) "
             "ORDER BY COALESCE(finished_at, updated_at) LIMIT ?2",
             db_now_sql(s));
    return select_rows(s, sql, before, limit, row_id, "list ended jobs", out, err);
}

md_status md_store_jobs_parts_left(md_store *s, const char *before, int limit, json_t **out,
                                   md_err *err)
{
    return select_rows(s,
                       "SELECT id, spec FROM jobs WHERE status IN " ENDED " AND "
                       "chunk_plan IS NOT NULL AND COALESCE(finished_at, updated_at) < ?1 "
                       "ORDER BY COALESCE(finished_at, updated_at) LIMIT ?2",
                       before, limit, row_id_spec, "list ended jobs' parts", out, err);
}

md_status md_store_job_removal_claim(md_store *s, const char *id, double lease_s,
                                     json_t **part_keys, md_err *err)
{
    char sql[512];
    json_t *keys = json_array();
    pthread_mutex_lock(&s->mu);
    md_status rc = txn_begin(s, err);
    if (rc != MD_OK)
        goto out;
    snprintf(sql, sizeof sql,
             "SELECT status, CASE WHEN removing_until > %s THEN 1 ELSE 0 END FROM jobs "
             "WHERE id = ?1",
             db_now_sql(s));
    md_ixstmt *st = prep(s, sql, err);
    if (!st)
        rc = MD_EIO;
    if (rc == MD_OK) {
        ix_bind_text(st, 1, id);
        int step = ix_step(st);
        const char *status = step == MD_IX_ROW ? ix_column_text(st, 0) : NULL;
        if (step == MD_IX_ERROR)
            rc = db_fail(s, err, "read the job");
        else if (step != MD_IX_ROW)
            rc = md_err_setc(err, MD_ENOTFOUND, "job_not_found",
                             "job %s does not exist; GET /jobs lists the jobs", id);
        else if (!status || (strcmp(status, "succeeded") && strcmp(status, "failed") &&
                             strcmp(status, "cancelled")))
            rc = md_err_setc(err, MD_ECONFLICT, "job_not_finished",
                             "job %s is %s: only an ended job is removed; cancel it with "
                             "DELETE /jobs/%s, then purge it once it reads cancelled",
                             id, status ? status : "?", id);
        else if (ix_column_int64(st, 1))
            rc = md_err_setc(err, MD_ECONFLICT, "job_removing",
                             "job %s is being removed (by this or another replica); GET "
                             "/jobs/%s answers 404 once it is gone",
                             id, id);
    }
    ix_finalize(st);
    /* the parts its chunks named: deleted by key if S3 refuses the listing */
    st = rc == MD_OK ? prep(s, "SELECT output_key FROM job_chunks WHERE job_id = ?1 AND "
                               "output_key IS NOT NULL", err)
                     : NULL;
    if (rc == MD_OK && !st)
        rc = MD_EIO;
    if (rc == MD_OK) {
        ix_bind_text(st, 1, id);
        int step;
        while ((step = ix_step(st)) == MD_IX_ROW)
            json_array_append_new(keys, json_string(ix_column_text(st, 0)));
        if (step == MD_IX_ERROR)
            rc = db_fail(s, err, "read the job's parts");
    }
    ix_finalize(st);
    /* the fence: a runner still on one of its chunks (of a job that failed
     * elsewhere, or was cancelled) finishes nothing from now on, and
     * deletes the part it put (scheduler.c) */
    if (rc == MD_OK)
        rc = exec1(s, "DELETE FROM job_chunks WHERE job_id = ?1", id, "fence the job's chunks",
                   NULL, err);
    if (rc == MD_OK) {
        snprintf(sql, sizeof sql, "UPDATE jobs SET removing_until = %s + ?1 WHERE id = ?2",
                 db_now_sql(s));
        st = prep(s, sql, err);
        if (!st)
            rc = MD_EIO;
        else {
            ix_bind_double(st, 1, lease_s);
            ix_bind_text(st, 2, id);
            if (ix_step(st) != MD_IX_DONE)
                rc = db_fail(s, err, "hold the job for its removal");
            ix_finalize(st);
        }
    }
    rc = txn_end(s, rc, TXN_KEEP, err);
out:
    pthread_mutex_unlock(&s->mu);
    if (rc == MD_OK)
        *part_keys = keys;
    else
        json_decref(keys);
    return rc;
}

/* exec1 as one write transaction of its own, taking the lock. */
static md_status write1(md_store *s, const char *sql, const char *p1, const char *what,
                        md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = txn_begin(s, err);
    if (rc == MD_OK) {
        rc = exec1(s, sql, p1, what, NULL, err);
        rc = txn_end(s, rc, TXN_KEEP, err);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_job_removal_release(md_store *s, const char *id, md_err *err)
{
    return write1(s, "UPDATE jobs SET removing_until = NULL WHERE id = ?1", id,
                  "give the job's removal back", err);
}

md_status md_store_job_parts_dropped(md_store *s, const char *id, md_err *err)
{
    return write1(s, "UPDATE jobs SET chunk_plan = NULL WHERE id = ?1 AND status IN " ENDED, id,
                  "record the job's parts dropped", err);
}

md_status md_store_job_delete(md_store *s, const char *id, md_err *err)
{
    char record[256];
    snprintf(record, sizeof record, "INSERT INTO jobs_removed (id, removed_at) VALUES (?1, %s)",
             db_iso_now_sql(s));
    pthread_mutex_lock(&s->mu);
    md_status rc = txn_begin(s, err);
    if (rc != MD_OK)
        goto out;
    int changed = 0;
    rc = exec1(s, "DELETE FROM jobs WHERE id = ?1", id, "remove the job", &changed, err);
    if (rc == MD_OK && changed != 1)
        rc = md_err_setc(err, MD_ENOTFOUND, "job_not_found",
                         "job %s does not exist; GET /jobs lists the jobs", id);
    if (rc == MD_OK)
        rc = exec1(s, "DELETE FROM job_chunks WHERE job_id = ?1", id, "remove the job's chunks",
                   NULL, err);
    /* every replica removes its own copy of the output when it reads this
     * (md_store_jobs_removed_since), at once when it hears the NOTIFY */
    if (rc == MD_OK)
        rc = exec1(s, record, id, "record the removal", NULL, err);
    if (rc == MD_OK)
        rc = ix_notify_change(s->ix, err);
    rc = txn_end(s, rc, TXN_KEEP, err);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_jobs_removed_among(md_store *s, json_t *ids, json_t **removed, md_err *err)
{
    enum { BATCH = 100 };
    json_t *found = json_array();
    md_status rc = MD_OK;
    /* the lock per batch: a long list never holds up leases and loads */
    for (size_t at = 0; rc == MD_OK && at < json_array_size(ids); at += BATCH) {
        size_t n = json_array_size(ids) - at;
        if (n > BATCH)
            n = BATCH;
        char sql[64 + BATCH * 8];
        size_t len = (size_t)snprintf(sql, sizeof sql, "SELECT id FROM jobs_removed WHERE id IN (");
        for (size_t i = 0; i < n; i++)
            len += (size_t)snprintf(sql + len, sizeof sql - len, "%s?%zu", i ? "," : "", i + 1);
        snprintf(sql + len, sizeof sql - len, ")");
        pthread_mutex_lock(&s->mu);
        md_ixstmt *st = prep(s, sql, err);
        if (!st)
            rc = MD_EIO;
        for (size_t i = 0; st && i < n; i++)
            ix_bind_text(st, (int)i + 1, json_string_value(json_array_get(ids, at + i)));
        int step = MD_IX_DONE;
        while (st && (step = ix_step(st)) == MD_IX_ROW)
            json_array_append_new(found, json_string(ix_column_text(st, 0)));
        ix_finalize(st);
        if (st && step == MD_IX_ERROR)
            rc = db_fail(s, err, "read removed jobs");
        pthread_mutex_unlock(&s->mu);
    }
    if (rc != MD_OK) {
        json_decref(found);
        return rc;
    }
    *removed = found;
    return MD_OK;
}

md_status md_store_jobs_removed_since(md_store *s, const char *since, int limit, json_t **out,
                                      md_err *err)
{
    return select_rows(s,
                       "SELECT id, removed_at FROM jobs_removed WHERE removed_at >= ?1 "
                       "ORDER BY removed_at LIMIT ?2",
                       since, limit, row_id_text, "read removed jobs", out, err);
}

md_status md_store_jobs_removed_prune(md_store *s, const char *before, md_err *err)
{
    return write1(s, "DELETE FROM jobs_removed WHERE removed_at < ?1", before,
                  "prune removed jobs", err);
}

void md_jobs_write_metrics(md_store *s, FILE *f)
{
    static const char *const states[] = {"queued", "running", "succeeded", "failed",
                                         "cancelled"};
    long long count[5] = {0}, rows[5] = {0};
    pthread_mutex_lock(&s->mu);
    md_err err;
    md_ixstmt *st =
        prep(s, "SELECT status, count(*), coalesce(sum(rows_done), 0) FROM jobs GROUP BY status",
             &err);
    int step = MD_IX_ERROR;
    while (st && (step = ix_step(st)) == MD_IX_ROW) {
        const char *status = ix_column_text(st, 0);
        for (int i = 0; status && i < 5; i++)
            if (!strcmp(status, states[i])) {
                count[i] = ix_column_int64(st, 1);
                rows[i] = ix_column_int64(st, 2);
            }
    }
    ix_finalize(st);
    pthread_mutex_unlock(&s->mu);
    char l[64];
    if (step != MD_IX_DONE) { /* the index did not answer (modeld_index_up): not zeros */
        md_jobs_write_chunk_metrics(f);
        md_jobs_write_removed_metrics(f);
        return;
    }
    md_prom_family(f, "modeld_jobs", "gauge", "Batch jobs in the store, by state.");
    for (int i = 0; i < 5; i++) {
        l[0] = '\0';
        md_prom_label(l, sizeof l, "state", states[i]);
        md_prom_sample(f, "modeld_jobs", l, (double)count[i]);
    }
    md_prom_family(f, "modeld_job_rows_done", "gauge",
                   "Rows committed by the store's batch jobs, by job state.");
    for (int i = 0; i < 5; i++) {
        l[0] = '\0';
        md_prom_label(l, sizeof l, "state", states[i]);
        md_prom_sample(f, "modeld_job_rows_done", l, (double)rows[i]);
    }
    md_jobs_write_chunk_metrics(f);
    md_jobs_write_removed_metrics(f);
}

/* ---- chunks of one job over every replica (issue 26) ----
 *
 * PostgreSQL only (md_store_jobs_chunked): a claim is one UPDATE of the
 * first claimable chunk picked with FOR UPDATE SKIP LOCKED, so runners of
 * every replica claim different chunks without waiting on one another;
 * leases are seconds on the DATABASE's clock (clock_timestamp()), never on
 * a host's. A chunk is finished only by the owner and attempt that claimed
 * it, inside one transaction that also adds its counts to the job's, so a
 * runner that lost its chunk (paused past its lease, then resumed) finishes
 * nothing, and every row is counted once. */

#define DB_NOW "extract(epoch from clock_timestamp())"

int md_store_jobs_chunked(md_store *s)
{
#ifdef MD_WITH_PG
    return s->ix->ops == &md_index_pg_ops;
#else
    (void)s;
    return 0;
#endif
}

md_status md_store_chunks_plan(md_store *s, const char *job_id, const char *owner, json_t *chunks,
                               json_t *plan, int *planned, md_err *err)
{
    *planned = 0;
    char *plan_text = json_dumps(plan, JSON_COMPACT);
    pthread_mutex_lock(&s->mu);
    md_status rc = txn_begin(s, err);
    if (rc != MD_OK)
        goto out;
    md_ixstmt *up = prep(s, "UPDATE jobs SET chunks_total = ?1, chunk_plan = ?2 WHERE id = ?3 AND "
                            "owner = ?4 AND chunks_total IS NULL", err);
    if (!up)
        rc = MD_EIO;
    if (rc == MD_OK) {
        ix_bind_int64(up, 1, (long long)json_array_size(chunks));
        ix_bind_text(up, 2, plan_text);
        ix_bind_text(up, 3, job_id);
        ix_bind_text(up, 4, owner);
        if (ix_step(up) != MD_IX_DONE)
            rc = db_fail(s, err, "plan job chunks");
        else if (ix_changes(s->ix) != 1)
            rc = md_err_setc(err, MD_ECONFLICT, "job_lease_lost",
                             "job %s is planned already or held by another process", job_id);
    }
    ix_finalize(up);
    md_ixstmt *ins = rc == MD_OK ? prep(s, "INSERT INTO job_chunks (job_id, seq, start_row, "
                                           "end_row, start_byte, end_byte) VALUES (?1,?2,?3,?4,?5,?6)",
                                        err)
                                 : NULL;
    if (rc == MD_OK && !ins)
        rc = MD_EIO;
    for (size_t i = 0; rc == MD_OK && i < json_array_size(chunks); i++) {
        json_t *c = json_array_get(chunks, i);
        ix_reset(ins);
        ix_bind_text(ins, 1, job_id);
        ix_bind_int64(ins, 2, (long long)i);
        for (int k = 0; k < 4; k++)
            ix_bind_int64(ins, 3 + k, json_integer_value(json_array_get(c, (size_t)k)));
        if (ix_step(ins) != MD_IX_DONE)
            rc = db_fail(s, err, "insert job chunk");
    }
    ix_finalize(ins);
    /* idle runners of every replica hear of the chunks at the commit; a job
     * of one chunk is left to its planner, which claims it next (and then
     * assembles from its own disk, not from S3) */
    if (rc == MD_OK && json_array_size(chunks) > 1)
        rc = ix_notify_change(s->ix, err);
    rc = txn_end(s, rc, TXN_KEEP, err);
    *planned = rc == MD_OK;
out:
    pthread_mutex_unlock(&s->mu);
    free(plan_text);
    return rc;
}

md_status md_store_chunk_plan_get(md_store *s, const char *job_id, json_t **plan, md_err *err)
{
    *plan = NULL;
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s, "SELECT chunk_plan FROM jobs WHERE id = ?1", err);
    if (!st)
        rc = MD_EIO;
    else {
        ix_bind_text(st, 1, job_id);
        int r = ix_step(st);
        if (r == MD_IX_ROW && ix_column_type(st, 0) != MD_IXT_NULL)
            *plan = json_col(st, 0);
        else if (r == MD_IX_ERROR)
            rc = db_fail(s, err, "read the job's chunk plan");
    }
    ix_finalize(st);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_chunk_claim(md_store *s, const char *owner, double lease_s, const char *only_job,
                               md_job_chunk *c, int *found, md_err *err)
{
    *found = 0;
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(
        s,
        "UPDATE job_chunks c SET status = 'running', owner = ?1, attempt = c.attempt + 1, "
        "lease_until = " DB_NOW " + ?2, "
        "taken_over = CASE WHEN c.status = 'running' THEN 1 ELSE 0 END "
        "FROM (SELECT k.job_id, k.seq FROM job_chunks k JOIN jobs j ON j.id = k.job_id "
        "      WHERE j.status IN ('queued','running') AND j.cancel_requested = 0 "
        "        AND (CAST(?3 AS TEXT) IS NULL OR k.job_id = ?3) "
        "        AND (k.status = 'pending' OR (k.status = 'running' AND k.lease_until < " DB_NOW "))"
        "      ORDER BY j.created_at, k.job_id, k.seq LIMIT 1 FOR UPDATE OF k SKIP LOCKED) pick "
        "WHERE c.job_id = pick.job_id AND c.seq = pick.seq "
        "RETURNING c.job_id, c.seq, c.start_row, c.end_row, c.start_byte, c.end_byte, c.attempt, "
        "c.taken_over",
        err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    ix_bind_text(st, 1, owner);
    ix_bind_double(st, 2, lease_s);
    if (only_job)
        ix_bind_text(st, 3, only_job);
    else
        ix_bind_null(st, 3);
    int r = ix_step(st);
    if (r == MD_IX_ROW) {
        memset(c, 0, sizeof *c);
        snprintf(c->job_id, sizeof c->job_id, "%s", ix_column_text(st, 0));
        c->seq = ix_column_int64(st, 1);
        c->start_row = ix_column_int64(st, 2);
        c->end_row = ix_column_int64(st, 3);
        c->start_byte = ix_column_int64(st, 4);
        c->end_byte = ix_column_int64(st, 5);
        c->attempt = ix_column_int64(st, 6);
        c->taken_over = (int)ix_column_int64(st, 7);
        *found = 1;
        r = ix_step(st);
    }
    if (r != MD_IX_DONE)
        rc = db_fail(s, err, "claim a job chunk");
    ix_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_chunk_renew(md_store *s, const md_job_chunk *c, const char *owner, double lease_s,
                               int *cancel_requested, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s,
                         "UPDATE job_chunks SET lease_until = " DB_NOW " + ?1 WHERE job_id = ?2 "
                         "AND seq = ?3 AND owner = ?4 AND attempt = ?5 AND status = 'running' "
                         "RETURNING COALESCE((SELECT CASE WHEN cancel_requested = 1 OR status "
                         "NOT IN ('queued','running') THEN 1 ELSE 0 END FROM jobs WHERE id = ?2), 1)",
                         err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    ix_bind_double(st, 1, lease_s);
    ix_bind_text(st, 2, c->job_id);
    ix_bind_int64(st, 3, c->seq);
    ix_bind_text(st, 4, owner);
    ix_bind_int64(st, 5, c->attempt);
    int r = ix_step(st);
    if (r == MD_IX_ROW) {
        if (cancel_requested)
            *cancel_requested = (int)ix_column_int64(st, 0);
        r = ix_step(st);
        if (r != MD_IX_DONE)
            rc = db_fail(s, err, "renew a job chunk");
    } else if (r == MD_IX_DONE) {
        rc = md_err_setc(err, MD_ECONFLICT, "chunk_lease_lost",
                         "chunk %lld of job %s is no longer held by this process (attempt %lld)",
                         (long long)c->seq, c->job_id, (long long)c->attempt);
    } else {
        rc = db_fail(s, err, "renew a job chunk");
    }
    ix_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_chunk_finish(md_store *s, const md_job_chunk *c, const char *owner,
                                const md_job_chunk_counts *n, const char *output_key,
                                int *all_done, md_err *err)
{
    *all_done = 0;
    char now[32];
    now_iso(now);
    pthread_mutex_lock(&s->mu);
    md_status rc = txn_begin(s, err);
    if (rc != MD_OK)
        goto out;
    md_ixstmt *st = prep(s,
                         "UPDATE job_chunks SET status = 'done', lease_until = NULL, rows_done = ?1, "
                         "rows_skipped = ?2, correct = ?3, labeled = ?4, confusion = ?5, "
                         "output_key = ?6, output_bytes = ?7 WHERE job_id = ?8 AND seq = ?9 AND "
                         "owner = ?10 AND attempt = ?11 AND status = 'running'",
                         err);
    if (!st)
        rc = MD_EIO;
    if (rc == MD_OK) {
        ix_bind_int64(st, 1, n->rows);
        ix_bind_int64(st, 2, n->skipped);
        ix_bind_int64(st, 3, n->correct);
        ix_bind_int64(st, 4, n->labeled);
        if (n->confusion)
            ix_bind_text(st, 5, n->confusion);
        else
            ix_bind_null(st, 5);
        ix_bind_text(st, 6, output_key);
        ix_bind_int64(st, 7, n->output_bytes);
        ix_bind_text(st, 8, c->job_id);
        ix_bind_int64(st, 9, c->seq);
        ix_bind_text(st, 10, owner);
        ix_bind_int64(st, 11, c->attempt);
        if (ix_step(st) != MD_IX_DONE)
            rc = db_fail(s, err, "finish a job chunk");
        else if (ix_changes(s->ix) != 1)
            rc = md_err_setc(err, MD_ECONFLICT, "chunk_lease_lost",
                             "chunk %lld of job %s was taken over (attempt %lld is not its "
                             "holder any more): this finish is refused",
                             (long long)c->seq, c->job_id, (long long)c->attempt);
    }
    ix_finalize(st);
    st = rc == MD_OK ? prep(s, "UPDATE jobs SET rows_done = rows_done + ?1, rows_skipped = "
                               "rows_skipped + ?2, correct = correct + ?3, labeled = labeled + ?4, "
                               "output_bytes = output_bytes + ?5, updated_at = ?6 WHERE id = ?7 "
                               /* a cancelled (or ended) job takes no more chunks: its
                                * output is assembled from what was done before; checked
                                * under the row's lock, which this UPDATE takes */
                               "AND status IN ('queued','running') AND cancel_requested = 0",
                            err)
                     : NULL;
    if (rc == MD_OK && !st)
        rc = MD_EIO;
    if (rc == MD_OK) {
        ix_bind_int64(st, 1, n->rows);
        ix_bind_int64(st, 2, n->skipped);
        ix_bind_int64(st, 3, n->correct);
        ix_bind_int64(st, 4, n->labeled);
        ix_bind_int64(st, 5, n->output_bytes);
        ix_bind_text(st, 6, now);
        ix_bind_text(st, 7, c->job_id);
        if (ix_step(st) != MD_IX_DONE)
            rc = db_fail(s, err, "count a job chunk");
        else if (ix_changes(s->ix) != 1)
            rc = md_err_setc(err, MD_ECONFLICT, "job_not_running",
                             "job %s was cancelled or has ended: chunk %lld is not taken", c->job_id,
                             (long long)c->seq);
    }
    ix_finalize(st);
    st = rc == MD_OK ? prep(s, "SELECT count(*) FROM job_chunks WHERE job_id = ?1 AND status != "
                               "'done'", err)
                     : NULL;
    if (rc == MD_OK && !st)
        rc = MD_EIO;
    if (rc == MD_OK) {
        ix_bind_text(st, 1, c->job_id);
        if (ix_step(st) == MD_IX_ROW)
            *all_done = ix_column_int64(st, 0) == 0;
        else
            rc = db_fail(s, err, "count a job's chunks");
    }
    ix_finalize(st);
    /* the UPDATE of the job's row above holds its lock to the commit, so
     * finishers of one job pass here one at a time and exactly one sees
     * the last chunk done: it wakes the job's coordinator, wherever it runs */
    if (rc == MD_OK && *all_done)
        rc = ix_notify_change(s->ix, err);
    rc = txn_end(s, rc, TXN_KEEP, err);
    if (rc != MD_OK)
        *all_done = 0;
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_chunk_release(md_store *s, const md_job_chunk *c, const char *owner, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s,
                         "UPDATE job_chunks SET status = 'pending', owner = NULL, lease_until = NULL "
                         "WHERE job_id = ?1 AND seq = ?2 AND owner = ?3 AND attempt = ?4 AND "
                         "status = 'running'",
                         err);
    if (!st)
        rc = MD_EIO;
    else {
        ix_bind_text(st, 1, c->job_id);
        ix_bind_int64(st, 2, c->seq);
        ix_bind_text(st, 3, owner);
        ix_bind_int64(st, 4, c->attempt);
        if (ix_step(st) != MD_IX_DONE)
            rc = db_fail(s, err, "release a job chunk");
        else if (ix_changes(s->ix) == 1)
            rc = ix_notify_change(s->ix, err); /* another replica may take it at once */
        else
            rc = md_err_setc(err, MD_ECONFLICT, "chunk_lease_lost",
                             "chunk %lld of job %s is no longer held by this process (attempt %lld)",
                             (long long)c->seq, c->job_id, (long long)c->attempt);
    }
    ix_finalize(st);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_chunks_list(md_store *s, const char *job_id, json_t **out, md_err *err)
{
    *out = NULL;
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s,
                         "SELECT seq, status, start_row, end_row, rows_done, output_key, "
                         "output_bytes, confusion, rows_skipped, correct, labeled FROM job_chunks "
                         "WHERE job_id = ?1 ORDER BY seq",
                         err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    ix_bind_text(st, 1, job_id);
    json_t *a = json_array();
    int r;
    while ((r = ix_step(st)) == MD_IX_ROW) {
        json_t *c = json_pack("{s:I,s:s,s:I,s:I,s:I,s:o,s:I,s:o}", "seq",
                              (json_int_t)ix_column_int64(st, 0), "status",
                              ix_column_text(st, 1) ? ix_column_text(st, 1) : "",
                              "start_row", (json_int_t)ix_column_int64(st, 2), "end_row",
                              (json_int_t)ix_column_int64(st, 3), "rows",
                              (json_int_t)ix_column_int64(st, 4), "output_key",
                              col_or_null(st, 5), "output_bytes",
                              (json_int_t)ix_column_int64(st, 6), "confusion",
                              ix_column_type(st, 7) == MD_IXT_NULL ? json_null() : json_col(st, 7));
        json_object_set_new(c, "skipped", json_integer(ix_column_int64(st, 8)));
        json_object_set_new(c, "correct", json_integer(ix_column_int64(st, 9)));
        json_object_set_new(c, "labeled", json_integer(ix_column_int64(st, 10)));
        json_array_append_new(a, c);
    }
    ix_finalize(st);
    if (r != MD_IX_DONE) {
        json_decref(a);
        rc = db_fail(s, err, "list a job's chunks");
        goto out;
    }
    *out = a;
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}
