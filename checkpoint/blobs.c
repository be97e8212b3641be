/*
 * blobs.c - the store's checkpoint files: the upload writer (temp file,
 * SHA-256 as bytes stream in, fsync), blob paths, and their garbage
 * collection (temp files of dead processes and unreferenced blobs swept at
 * open, blobs released when their last row is deleted). Why each step is
 * ordered as it is, and how replicas sharing the store stay safe: DESIGN in
 * store.c.
 */
#define _GNU_SOURCE
#include "store_internal.h"
#include "formats.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define ORPHAN_GRACE_S 600

static int fsync_dir(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* fsync blobs/, so a rename or unlink there survives a power loss. */
md_status md_blobs_sync_dir(md_store *s, md_err *err)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/blobs", s->dir);
    if (fsync_dir(dir) != 0)
        return md_err_set(err, MD_EIO, "store %s: fsync of blobs/ failed: %s; check the disk",
                          s->dir, strerror(errno));
    return MD_OK;
}

/* Temp files of processes that are gone: tmp/upload-<pid>-XXXXXX. */
void md_blobs_sweep_tmp(md_store *s)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/tmp", s->dir);
    DIR *d = opendir(path);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        long pid = 0;
        int owned = sscanf(e->d_name, "upload-%ld-", &pid) == 1 && pid > 0;
        if (owned && pid != (long)getpid() && (kill((pid_t)pid, 0) == 0 || errno == EPERM))
            continue; /* a live replica is still writing it */
        char full[4352];
        snprintf(full, sizeof full, "%s/%s", path, e->d_name);
        if (unlink(full) == 0)
            md_log(MD_LOG_INFO, "store: removed stale temp file %s", full);
    }
    closedir(d);
}

static int sha_referenced(md_store *s, const char *sha)
{
    md_ixstmt *st = prep(s,
                            "SELECT 1 FROM versions WHERE sha256 = ?1 OR arch_sha256 = ?1 "
                            "UNION ALL SELECT 1 FROM models WHERE arch_sha256 = ?1 LIMIT 1",
                            NULL);
    if (!st)
        return 1; /* when unsure, keep the file */
    ix_bind_text(st, 1, sha);
    int rc = ix_step(st);
    ix_finalize(st);
    return rc != MD_IX_DONE;
}

/* Blobs no row references (a crash between rename and commit), decided and
 * unlinked inside a write transaction (see DESIGN). */
void md_blobs_sweep_orphans(md_store *s)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/blobs", s->dir);
    DIR *d = opendir(path);
    if (!d)
        return;
    md_err err;
    if (txn_begin(s, &err) != MD_OK) {
        md_log(MD_LOG_WARN, "store: orphan sweep skipped: %s", err.msg);
        closedir(d);
        return;
    }
    hook(s, "sweep_locked");
    struct dirent *e;
    time_t now = time(NULL);
    while ((e = readdir(d))) {
        if (strlen(e->d_name) != 64)
            continue;
        char full[4352];
        snprintf(full, sizeof full, "%s/%s", path, e->d_name);
        struct stat sb;
        if (stat(full, &sb) != 0 || now - sb.st_mtime < ORPHAN_GRACE_S)
            continue;
        if (!sha_referenced(s, e->d_name) && unlink(full) == 0)
            md_log(MD_LOG_INFO, "store: removed unreferenced blob %s", full);
    }
    closedir(d);
    if (md_blobs_sync_dir(s, &err) != MD_OK)
        md_log(MD_LOG_WARN, "%s", err.msg);
    /* nothing written: ends the transaction (never left inside it: it holds
     * the write lock every replica shares) */
    if (txn_end(s, MD_OK, TXN_KEEP, &err) != MD_OK)
        md_log(MD_LOG_WARN, "store: orphan sweep: %s", err.msg);
}

/* Rows whose blob is missing are marked failed with the reason. */
md_status md_blobs_check(md_store *s, md_err *err)
{
    if (bl_remote(s->blobs))
        return MD_OK; /* blobs/ is a cache: a file not there is fetched when needed */
    md_ixstmt *st = prep(s, "SELECT model, version, sha256 FROM versions WHERE state != "
                               "'failed' OR state_reason NOT LIKE 'checkpoint file %'", err);
    if (!st)
        return MD_EIO;
    md_ixstmt *up = prep(s, "UPDATE versions SET state = 'failed', state_reason = ? WHERE "
                               "model = ? AND version = ?", err);
    if (!up) {
        ix_finalize(st);
        return MD_EIO;
    }
    int step;
    while ((step = ix_step(st)) == MD_IX_ROW) {
        const char *sha = ix_column_text(st, 2);
        char path[4096];
        blob_path(s, sha, path, sizeof path);
        if (access(path, R_OK) == 0)
            continue;
        char reason[4200];
        snprintf(reason, sizeof reason, "checkpoint file %s is missing; upload the version again",
                 path);
        ix_bind_text(up, 1, reason);
        ix_bind_text(up, 2, ix_column_text(st, 0));
        ix_bind_int64(up, 3, (int)ix_column_int64(st, 1));
        int urc = ix_step(up);
        ix_reset(up);
        if (urc != MD_IX_DONE) {
            ix_finalize(up);
            ix_finalize(st);
            return db_fail(s, err, "mark a version with a missing blob failed");
        }
        md_log(MD_LOG_WARN, "model %s version %d: %s", ix_column_text(st, 0),
               (int)ix_column_int64(st, 1), reason);
    }
    ix_finalize(up);
    md_status rc = step == MD_IX_ERROR ? db_fail(s, err, "list the versions' blobs") : MD_OK;
    ix_finalize(st);
    return rc;
}

/* ---- blobs ---- */

md_status md_store_tmpfile(md_store *s, int *fd, md_err *err)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/tmp/upload-%ld-XXXXXX", s->dir, (long)getpid());
    *fd = mkostemp(path, O_CLOEXEC);
    if (*fd < 0)
        return md_err_set(err, MD_EIO, "store %s: cannot create a temp file in tmp/: %s; check "
                          "the store's disk and permissions", s->dir, strerror(errno));
    /* unnamed at once: it goes when the last descriptor closes; a crash in
     * between leaves an upload- file md_blobs_sweep_tmp removes */
    unlink(path);
    return MD_OK;
}

md_status md_blob_begin(md_store *s, long long max_bytes, md_blob_writer **out, md_err *err)
{
    *out = NULL;
    md_blob_writer *w = md_xcalloc(1, sizeof *w);
    w->store = s;
    w->max_bytes = max_bytes;
    snprintf(w->tmp_path, sizeof w->tmp_path, "%s/tmp/upload-%ld-XXXXXX", s->dir, (long)getpid());
    w->fd = mkostemp(w->tmp_path, O_CLOEXEC);
    if (w->fd < 0) {
        md_err_set(err, MD_EIO, "store %s: cannot create a temp file in tmp/: %s", s->dir,
                   strerror(errno));
        free(w);
        return MD_EIO;
    }
    w->sha = EVP_MD_CTX_new();
    if (!w->sha || EVP_DigestInit_ex(w->sha, EVP_sha256(), NULL) != 1) {
        md_blob_abort(w);
        return md_err_set(err, MD_EINTERNAL, "cannot start SHA-256");
    }
    *out = w;
    return MD_OK;
}

md_status md_blob_write(md_blob_writer *w, const void *data, size_t len, md_err *err)
{
    if ((long long)len > w->max_bytes - w->size)
        return md_err_setc(err, MD_ETOOBIG, "checkpoint_too_large",
                           "checkpoint is larger than the limit of %lld bytes; raise "
                           "max_checkpoint_bytes to accept it",
                           w->max_bytes);
    const char *p = data;
    size_t left = len;
    while (left) {
        ssize_t n = write(w->fd, p, left);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == ENOSPC || errno == EDQUOT)
                return md_err_set(err, MD_ENOSPC,
                                  "store %s: no space left for the checkpoint (%lld bytes "
                                  "written); free space on the store's filesystem, or delete "
                                  "old versions",
                                  w->store->dir, w->size + (long long)(len - left));
            return md_err_set(err, MD_EIO, "store %s: writing the checkpoint failed: %s",
                              w->store->dir, strerror(errno));
        }
        p += n;
        left -= (size_t)n;
    }
    EVP_DigestUpdate(w->sha, data, len);
    w->size += (long long)len;
    return MD_OK;
}

md_status md_blob_adopt(md_blob_writer *w, md_err *err)
{
    static __thread char buf[1 << 16];
    off_t off = 0;
    for (;;) {
        ssize_t n = pread(w->fd, buf, sizeof buf, off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return md_err_set(err, MD_EIO, "store %s: reading back the download failed: %s",
                              w->store->dir, strerror(errno));
        if (n == 0)
            break;
        if ((long long)n > w->max_bytes - w->size)
            return md_err_setc(err, MD_ETOOBIG, "checkpoint_too_large",
                               "checkpoint is larger than the limit of %lld bytes; raise "
                               "max_checkpoint_bytes to accept it",
                               w->max_bytes);
        EVP_DigestUpdate(w->sha, buf, (size_t)n);
        w->size += n;
        off += n;
    }
    if (lseek(w->fd, 0, SEEK_END) < 0)
        return md_err_set(err, MD_EIO, "store %s: %s", w->store->dir, strerror(errno));
    return MD_OK;
}

long long md_blob_size(const md_blob_writer *w) { return w->size; }

const char *md_blob_path(const md_blob_writer *w) { return w->tmp_path; }

const char *md_blob_sha256(const md_blob_writer *w) { return w->finished ? w->sha256 : ""; }

void md_store_sha_path(const md_store *s, const char *sha, char *out, size_t size)
{
    blob_path(s, sha, out, size);
}

void md_blob_abort(md_blob_writer *w)
{
    if (!w)
        return;
    if (w->key[0]) {
        /* uploaded, and no row names it: nothing else will ever delete it
         * (failing, the orphan sweep will, after its grace period) */
        md_err err;
        if (bl_remove(w->store->blobs, w->key, &err) != MD_OK)
            md_log(MD_LOG_WARN, "store: the unused upload %s is left for the orphan sweep: %s",
                   w->key, err.msg);
    }
    if (w->fd >= 0)
        close(w->fd);
    if (w->tmp_path[0])
        unlink(w->tmp_path);
    EVP_MD_CTX_free(w->sha);
    free(w);
}

md_status md_blob_link(const md_blob_writer *w, md_blob_writer **out, md_err *err)
{
    static atomic_ulong seq;
    *out = NULL;
    md_assert(w->finished);
    md_blob_writer *c = md_xcalloc(1, sizeof *c);
    c->store = w->store;
    c->fd = -1;
    c->size = w->size;
    c->max_bytes = w->max_bytes;
    c->finished = 1;
    memcpy(c->sha256, w->sha256, sizeof c->sha256);
    /* upload-<pid>-: swept like any temp file of this process once it is gone */
    snprintf(c->tmp_path, sizeof c->tmp_path, "%s/tmp/upload-%ld-link%lu", w->store->dir,
             (long)getpid(), atomic_fetch_add(&seq, 1));
    if (link(w->tmp_path, c->tmp_path) != 0) {
        md_err_set(err, MD_EIO, "store %s: cannot link the downloaded checkpoint %s: %s",
                   w->store->dir, w->tmp_path, strerror(errno));
        free(c);
        return MD_EIO;
    }
    *out = c;
    return MD_OK;
}

/* What a checkpoint blob may hold (issue 12): a safetensors file (its
 * reader checks it in full when it is loaded), a zip (TorchScript or
 * torch.save: md_archive_check), and not the legacy torch.save format. */
static md_status blob_format_check(const char *path, md_err *err)
{
    uint8_t head[16];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, head, sizeof head) : -1;
    if (fd >= 0)
        close(fd);
    md_ckpt_format f = md_ckpt_sniff(head, n > 0 ? (size_t)n : 0);
    if (f == MD_CKPT_SAFETENSORS)
        return MD_OK;
    if (f == MD_CKPT_LEGACY)
        return md_err_setc(err, MD_EUNPROC, "legacy_checkpoint",
                           "the checkpoint is in the legacy (pre-1.6) torch.save format; re-save "
                           "it with torch.save(..., _use_new_zipfile_serialization=True)");
    return md_archive_check(path, err);
}

md_status md_blob_finish(md_blob_writer *w, const char *expect, char sha256[MD_SHA256_HEX],
                         long long *size, md_err *err)
{
    md_status st = MD_OK;
    unsigned char digest[32];
    unsigned int dlen = 0;
    if (w->size == 0) {
        st = md_err_setc(err, MD_EINVAL, "empty_checkpoint",
                         "the checkpoint is empty; send the bytes of a TorchScript file "
                         "(torch.jit.save)");
        goto fail;
    }
    if (EVP_DigestFinal_ex(w->sha, digest, &dlen) != 1 || dlen != 32) {
        st = md_err_set(err, MD_EINTERNAL, "store %s: computing the checkpoint's SHA-256 failed",
                        w->store->dir);
        goto fail;
    }
    for (unsigned i = 0; i < 32; i++)
        snprintf(w->sha256 + 2 * i, 3, "%02x", digest[i]);
    if (expect && *expect && strcasecmp(expect, w->sha256) != 0) {
        st = md_err_setc(err, MD_EINVAL, "sha256_mismatch",
                         "the checkpoint's sha256 is %s but %s was expected; check the file or the "
                         "sha256 given",
                         w->sha256, expect);
        goto fail;
    }
    if (fsync(w->fd) != 0) {
        st = md_err_set(err, MD_EIO, "store %s: fsync of the checkpoint failed: %s",
                        w->store->dir, strerror(errno));
        goto fail;
    }
    if ((st = blob_format_check(w->tmp_path, err)) != MD_OK)
        goto fail;
    close(w->fd);
    w->fd = -1;
    w->finished = 1;
    memcpy(sha256, w->sha256, MD_SHA256_HEX);
    *size = w->size;
    return MD_OK;
fail:
    md_blob_abort(w);
    return st;
}

/* ---- garbage collection ---- */

/* Unlink the blob if no row references it any more. Caller holds the mutex
 * and a write transaction, so no replica adds a row for it meanwhile. */
static void release_blob(md_store *s, const char *sha)
{
    if (sha_referenced(s, sha))
        return;
    char path[4096];
    blob_path(s, sha, path, sizeof path);
    if (unlink(path) == 0)
        md_log(MD_LOG_DEBUG, "store: removed blob %s", path);
    if (!bl_remote(s->blobs))
        return;
    /* mark: the collector thread deletes each object, then its row (so a
     * row of blob_keys outlives its object, never the reverse); no row can
     * name these bytes again without uploading them anew (blobs_impl.h) */
    md_ixstmt *st = prep(s, "UPDATE blob_keys SET state = 'deleting' WHERE sha256 = ?1 AND "
                            "state = 'live'", NULL);
    ix_bind_text(st, 1, sha);
    if (ix_step(st) != MD_IX_DONE)
        md_log(MD_LOG_WARN, "store: the objects of blob %s are left for the orphan sweep", sha);
    ix_finalize(st);
}

void md_sha_list_add(sha_list *l, const char *sha)
{
    l->items = realloc(l->items, sizeof *l->items * (size_t)(l->count + 1));
    md_assert(l->items != NULL);
    snprintf(l->items[l->count++], MD_SHA256_HEX, "%s", sha);
}

/* Garbage-collect the blobs of rows just deleted (committed), in a write
 * transaction of its own: a replica's add of the same bytes either committed
 * its row before (the blob stays) or checks for the file after (and puts it
 * back). Caller holds the mutex, not a transaction. A failure only leaves an
 * unreferenced blob, which the sweep at open removes. */
void md_blobs_release_all(md_store *s, sha_list *l)
{
    md_err err;
    if (l->count && txn_begin(s, &err) == MD_OK) {
        hook(s, "gc_locked");
        for (int i = 0; i < l->count; i++)
            release_blob(s, l->items[i]);
        if (md_blobs_sync_dir(s, &err) != MD_OK)
            md_log(MD_LOG_WARN, "%s", err.msg);
        if (txn_end(s, MD_OK, TXN_KEEP, &err) != MD_OK)
            md_log(MD_LOG_WARN, "store: blob collection: %s", err.msg);
        else if (s->gc_started) {
            pthread_mutex_lock(&s->gc_mu);
            s->gc_kick = 1;
            pthread_cond_signal(&s->gc_cv);
            pthread_mutex_unlock(&s->gc_mu);
        }
    } else if (l->count) {
        md_log(MD_LOG_WARN, "store: unreferenced blobs kept for the next sweep: %s", err.msg);
    }
    free(l->items);
    l->items = NULL;
    l->count = 0;
}

void md_blobs_settle(md_store *s, md_status rc, sha_list *released, const char *moved_sha)
{
    if (rc != MD_OK) {
        /* rolled back: the rows `released` listed are still there */
        free(released->items);
        released->items = NULL;
        released->count = 0;
        if (moved_sha)
            md_sha_list_add(released, moved_sha);
    }
    md_blobs_release_all(s, released);
}

md_status md_blob_place(md_store *s, md_blob_writer *blob, const char *what, int *moved,
                        md_err *err)
{
    char path[4096];
    struct stat sb;
    md_assert(blob && blob->finished);
    blob_path(s, blob->sha256, path, sizeof path);
    *moved = 0;
    if (stat(path, &sb) == 0) {
        unlink(blob->tmp_path); /* the same bytes are already stored */
    } else if (rename(blob->tmp_path, path) != 0) {
        return md_err_set(err, MD_EIO, "store %s: cannot move the %s into blobs/: %s", s->dir,
                          what, strerror(errno));
    } else {
        *moved = 1;
    }
    blob->tmp_path[0] = '\0';
    int live = bl_remote(s->blobs) && md_blob_stored_locked(s, blob->sha256);
    if (bl_remote(s->blobs) && !blob->key[0] && !live)
        /* md_blob_upload saw these bytes stored and skipped its upload; a
         * collector marked that object since: nothing holds them now */
        return md_err_setc(err, MD_EBUSY, "blob_collected",
                           "store %s: the stored copy of this %s was being deleted during the "
                           "upload; retry", s->dir, what);
    if (blob->key[0]) {
        /* the object md_blob_upload put, owned by this transaction's rows;
         * when another upload of the same bytes committed first, kept as a
         * duplicate the collector deletes */
        char now[32];
        now_iso(now);
        md_ixstmt *st = prep(s, "INSERT INTO blob_keys (key, sha256, state, created_at) "
                                "VALUES (?1, ?2, ?4, ?3)", err);
        if (!st)
            return MD_EIO;
        ix_bind_text(st, 1, blob->key);
        ix_bind_text(st, 2, blob->sha256);
        ix_bind_text(st, 3, now);
        ix_bind_text(st, 4, live ? "deleting" : "live");
        md_status rc = ix_step(st) == MD_IX_DONE ? MD_OK : db_fail(s, err, "record the upload");
        ix_finalize(st);
        if (rc != MD_OK)
            return rc;
    }
    return md_blobs_sync_dir(s, err);
}

/* ---- the blobs backend (blobs_impl.h): uploads, fetches, the collector ---- */

md_status md_blob_upload(md_store *s, md_blob_writer *blob, md_err *err)
{
    md_assert(blob && blob->finished);
    if (!bl_remote(s->blobs))
        return MD_OK;
    /* the same bytes stored already: no second upload (md_blob_place checks
     * again inside the transaction that names them) */
    pthread_mutex_lock(&s->mu);
    int stored = md_blob_stored_locked(s, blob->sha256);
    pthread_mutex_unlock(&s->mu);
    if (stored)
        return MD_OK;
    return bl_put(s->blobs, blob->sha256, blob->tmp_path, blob->key, err);
}

void md_blob_committed(md_blob_writer *blob, md_status rc)
{
    if (!blob || rc != MD_OK)
        return;
    blob->key[0] = '\0'; /* a row names it now: it is the collector's */
    bl_trim(blob->store->blobs); /* S3: the upload's file joined the cache */
}

int md_blob_stored_locked(md_store *s, const char *sha)
{
    if (!bl_remote(s->blobs)) {
        char path[4096];
        blob_path(s, sha, path, sizeof path);
        return access(path, R_OK) == 0;
    }
    md_ixstmt *st = prep(s, "SELECT 1 FROM blob_keys WHERE sha256 = ?1 AND state = 'live' LIMIT 1",
                         NULL);
    ix_bind_text(st, 1, sha);
    int found = ix_step(st) == MD_IX_ROW;
    ix_finalize(st);
    return found;
}

static md_status fetch_by_key(md_store *s, const char *sha, md_err *err);

md_status md_store_blob_fetch(md_store *s, const char *sha, char *path, size_t size, md_err *err)
{
    blob_path(s, sha, path, size);
    /* cached first: the index is not asked for a file this replica has */
    md_status st = bl_fetch(s->blobs, sha, NULL, err);
    if (st == MD_ENOTFOUND && bl_remote(s->blobs))
        st = fetch_by_key(s, sha, err);
    if (st == MD_ENOTFOUND)
        bl_pin(s->blobs, sha, 1); /* so that every MD_OK or MD_ENOTFOUND pairs with a release */
    return st;
}

/* The blob is not cached: download it from the object a live key names. */
static md_status fetch_by_key(md_store *s, const char *sha, md_err *err)
{
    md_status st = MD_OK;
    char key[MD_BLOB_KEY_MAX] = "";
    pthread_mutex_lock(&s->mu);
    md_ixstmt *q = prep(s, "SELECT key FROM blob_keys WHERE sha256 = ?1 AND state = 'live' "
                           "ORDER BY created_at LIMIT 1", err);
    ix_bind_text(q, 1, sha);
    int step = ix_step(q);
    if (step == MD_IX_ROW)
        snprintf(key, sizeof key, "%s", ix_column_text(q, 0));
    ix_finalize(q);
    if (step == MD_IX_ERROR)
        st = db_fail(s, err, "find the object holding a blob");
    pthread_mutex_unlock(&s->mu);
    if (step == MD_IX_ERROR)
        return st;
    return bl_fetch(s->blobs, sha, key, err); /* the network, without the mutex */
}

void md_store_blob_release(md_store *s, const char *sha)
{
    if (s && sha)
        bl_pin(s->blobs, sha, 0);
}

/* The grace period of the orphan sweeps (MD_TEST_ORPHAN_GRACE_S for tests). */
static long orphan_grace_s(void)
{
    const char *t = getenv("MD_TEST_ORPHAN_GRACE_S");
    return t && atol(t) >= 0 && t[0] ? atol(t) : ORPHAN_GRACE_S;
}

/* Delete the objects garbage collection marked, then their rows. Returns
 * how many it deleted. */
static int collect_marked(md_store *s)
{
    enum { BATCH = 64 };
    char (*keys)[MD_BLOB_KEY_MAX] = md_xcalloc(BATCH, sizeof *keys);
    int n = 0, done = 0;
    pthread_mutex_lock(&s->mu);
    md_ixstmt *st = prep(s, "SELECT key FROM blob_keys WHERE state = 'deleting' LIMIT 64", NULL);
    while (n < BATCH && ix_step(st) == MD_IX_ROW)
        snprintf(keys[n++], MD_BLOB_KEY_MAX, "%s", ix_column_text(st, 0));
    ix_finalize(st);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < n; i++) {
        md_err err;
        if (bl_remove(s->blobs, keys[i], &err) != MD_OK) {
            md_log(MD_LOG_WARN, "store: deleting %s failed (retried later): %s", keys[i],
                   err.msg);
            break; /* S3 is failing: the rest waits for the next pass */
        }
        pthread_mutex_lock(&s->mu);
        md_status rc = txn_begin(s, &err);
        if (rc == MD_OK) {
            md_ixstmt *del = prep(s, "DELETE FROM blob_keys WHERE key = ?1 AND state = 'deleting'",
                                  &err);
            ix_bind_text(del, 1, keys[i]);
            rc = ix_step(del) == MD_IX_DONE ? MD_OK : db_fail(s, &err, "drop a deleted object");
            ix_finalize(del);
            rc = txn_end(s, rc, TXN_KEEP, &err);
        }
        pthread_mutex_unlock(&s->mu);
        if (rc == MD_OK) {
            done++;
            md_log(MD_LOG_DEBUG, "store: deleted object %s", keys[i]);
        }
    }
    free(keys);
    return done;
}

/* Whether `key` is one md_blob_upload makes: blobs/<64 hex>/<32 hex>.
 * Anything else under the prefix is not modeld's to delete. */
static int own_key(const char *key)
{
    if (strncmp(key, "blobs/", 6) != 0 || strlen(key) != 6 + 64 + 1 + 32 || key[70] != '/')
        return 0;
    for (int i = 6; key[i]; i++)
        if (i != 70 && !((key[i] >= '0' && key[i] <= '9') || (key[i] >= 'a' && key[i] <= 'f')))
            return 0;
    return 1;
}

typedef struct orphan_scan {
    md_store *s;
    long grace;
    int removed;
} orphan_scan;

/* One listed object: deleted when it is older than the grace and no row of
 * blob_keys names it (an upload whose row never committed). */
static int on_listed(void *ctx, const char *key, long long age_s)
{
    orphan_scan *o = ctx;
    md_store *s = o->s;
    if (__atomic_load_n(&s->gc_stop, __ATOMIC_RELAXED))
        return 1; /* closing */
    if (age_s < o->grace || !own_key(key))
        return 0;
    pthread_mutex_lock(&s->mu);
    md_ixstmt *st = prep(s, "SELECT 1 FROM blob_keys WHERE key = ?1", NULL);
    ix_bind_text(st, 1, key);
    int step = ix_step(st);
    ix_finalize(st);
    pthread_mutex_unlock(&s->mu);
    if (step != MD_IX_DONE)
        return step == MD_IX_ERROR; /* named (kept), or the index is down: stop */
    md_err err;
    if (bl_remove(s->blobs, key, &err) == MD_OK) {
        o->removed++;
        md_log(MD_LOG_INFO, "store: removed the orphan object %s (no row names it)", key);
        return 0;
    }
    md_log(MD_LOG_WARN, "store: orphan sweep: %s", err.msg);
    return 1;
}

/* Live keys of bytes no row names (a collection whose transaction failed:
 * the index was down) are marked too, in a write transaction, so that no
 * object is kept forever. */
static void mark_unnamed(md_store *s)
{
    md_err err;
    pthread_mutex_lock(&s->mu);
    md_status rc = txn_begin(s, &err);
    if (rc == MD_OK) {
        rc = exec(s,
                  "UPDATE blob_keys SET state = 'deleting' WHERE state = 'live' AND NOT EXISTS "
                  "(SELECT 1 FROM versions WHERE versions.sha256 = blob_keys.sha256 OR "
                  "versions.arch_sha256 = blob_keys.sha256) AND NOT EXISTS (SELECT 1 FROM "
                  "models WHERE models.arch_sha256 = blob_keys.sha256)",
                  &err);
        rc = txn_end(s, rc, TXN_KEEP, &err);
    }
    pthread_mutex_unlock(&s->mu);
    if (rc != MD_OK)
        md_log(MD_LOG_WARN, "store: marking unnamed objects skipped: %s", err.msg);
}

static void *gc_main(void *arg)
{
    md_store *s = arg;
    time_t next_sweep = 0; /* at start, then hourly */
    pthread_mutex_lock(&s->gc_mu);
    while (!s->gc_stop) {
        pthread_mutex_unlock(&s->gc_mu);
        while (collect_marked(s) == 64)
            ;
        if (time(NULL) >= next_sweep) {
            mark_unnamed(s);
            while (collect_marked(s) == 64)
                ;
            orphan_scan o = {s, orphan_grace_s(), 0};
            md_err err;
            if (bl_list(s->blobs, on_listed, &o, &err) != MD_OK)
                md_log(MD_LOG_WARN, "store: orphan sweep of S3 skipped: %s", err.msg);
            next_sweep = time(NULL) + (getenv("MD_TEST_ORPHAN_GRACE_S") ? 5 : 3600);
        }
        pthread_mutex_lock(&s->gc_mu);
        if (s->gc_stop)
            break;
        if (!s->gc_kick) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += getenv("MD_TEST_ORPHAN_GRACE_S") ? 1 : 60;
            pthread_cond_timedwait(&s->gc_cv, &s->gc_mu, &until);
        }
        s->gc_kick = 0;
    }
    pthread_mutex_unlock(&s->gc_mu);
    return NULL;
}

void md_blobs_start_gc(md_store *s)
{
    if (!bl_remote(s->blobs))
        return;
    if (pthread_create(&s->gc_thread, NULL, gc_main, s) == 0)
        s->gc_started = 1;
    else
        md_log(MD_LOG_WARN, "store: no collector thread; S3 objects are collected at the next "
                            "start");
}

void md_blobs_stop_gc(md_store *s)
{
    if (!s->gc_started)
        return;
    pthread_mutex_lock(&s->gc_mu);
    __atomic_store_n(&s->gc_stop, 1, __ATOMIC_RELAXED);
    pthread_cond_signal(&s->gc_cv);
    pthread_mutex_unlock(&s->gc_mu);
    pthread_join(s->gc_thread, NULL);
    s->gc_started = 0;
}
