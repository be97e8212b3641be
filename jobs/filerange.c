/*
 * filerange.c - see filerange.h.
 */
#define _GNU_SOURCE /* pipe2 */
#include "filerange.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PIECE (1 << 20)

struct md_filerange {
    int src, wfd;
    char tag[64]; /* size and mtime at open */
    long long from[2], to[2];
    int nseg;
    pthread_t thread;
    int started;
    atomic_int stop;
    pthread_mutex_t mu;
    md_status st; /* under mu */
    md_err err;
};

static void *range_main(void *arg)
{
    md_filerange *r = arg;
    /* a reader that stopped early closes the read end: EPIPE here, not
     * SIGPIPE for the process */
    sigset_t pipe_set;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, NULL);
    md_err err;
    md_err_clear(&err);
    char *buf = malloc(PIECE);
    md_status st = buf ? MD_OK : md_err_set(&err, MD_ENOMEM, "no memory for a file read buffer");
    for (int seg = 0; st == MD_OK && seg < r->nseg && !atomic_load(&r->stop); seg++) {
        for (long long off = r->from[seg]; off < r->to[seg] && !atomic_load(&r->stop);) {
            size_t want = r->to[seg] - off < PIECE ? (size_t)(r->to[seg] - off) : PIECE;
            ssize_t got = pread(r->src, buf, want, (off_t)off);
            if (got < 0 && errno == EINTR)
                continue;
            if (got < 0) {
                st = md_err_set(&err, MD_EIO, "reading the job's input at byte %lld failed: %s",
                                off, strerror(errno));
                break;
            }
            if (got == 0) { /* the data changed under the plan: as an S3 If-Match */
                st = md_err_setc(&err, MD_ECONFLICT, "input_changed",
                                 "the job's input ends at byte %lld, before the %lld its plan "
                                 "read: it changed since the job was planned; run the job again",
                                 off, r->to[seg]);
                break;
            }
            for (ssize_t done = 0; done < got;) {
                ssize_t w = write(r->wfd, buf + done, (size_t)(got - done));
                if (w < 0 && errno == EINTR)
                    continue;
                if (w <= 0) {
                    atomic_store(&r->stop, 1); /* EPIPE: the reader is gone */
                    break;
                }
                done += w;
            }
            off += got;
        }
    }
    free(buf);
    pthread_mutex_lock(&r->mu);
    r->st = st;
    r->err = err;
    pthread_mutex_unlock(&r->mu);
    close(r->wfd); /* EOF for the reader, after the status is set */
    r->wfd = -1;
    return NULL;
}

md_status md_filerange_open(int src, long long head, long long from, long long to, int *fd,
                            md_filerange **out, md_err *err)
{
    *fd = -1;
    *out = NULL;
    struct stat sb;
    if (fstat(src, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(src);
        return md_err_set(err, MD_EINVAL, "the job's input is not a regular file");
    }
    md_filerange *r = calloc(1, sizeof *r);
    if (!r) {
        close(src);
        return md_err_set(err, MD_ENOMEM, "no memory for a file range");
    }
    r->src = src;
    r->wfd = -1;
    snprintf(r->tag, sizeof r->tag, "%lld:%lld.%09ld", (long long)sb.st_size,
             (long long)sb.st_mtim.tv_sec, (long)sb.st_mtim.tv_nsec);
    pthread_mutex_init(&r->mu, NULL);
    /* a range past the end is not cut to it: the reads then find the end
     * early, and say the file changed since its plan */
    if (to < 0)
        to = (long long)sb.st_size;
    if (from < head)
        from = head; /* [0, to) read once */
    if (head > 0) {
        r->from[r->nseg] = 0;
        r->to[r->nseg++] = head;
    }
    if (from < to) {
        r->from[r->nseg] = from;
        r->to[r->nseg++] = to;
    }
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
        md_status st = md_err_set(err, MD_EIO, "cannot make a pipe: %s", strerror(errno));
        md_filerange_close(r);
        return st;
    }
    r->wfd = p[1];
    if (pthread_create(&r->thread, NULL, range_main, r) != 0) {
        close(p[0]);
        md_filerange_close(r);
        return md_err_set(err, MD_EIO, "cannot start the reader thread of a job's input");
    }
    r->started = 1;
    *fd = p[0];
    *out = r;
    return MD_OK;
}

const char *md_filerange_tag(const md_filerange *r) { return r->tag; }

md_status md_filerange_status(md_filerange *r, md_err *err)
{
    pthread_mutex_lock(&r->mu);
    md_status st = r->st;
    if (st != MD_OK && err)
        *err = r->err;
    pthread_mutex_unlock(&r->mu);
    return st;
}

void md_filerange_close(md_filerange *r)
{
    if (!r)
        return;
    atomic_store(&r->stop, 1);
    if (r->started)
        pthread_join(r->thread, NULL);
    else if (r->wfd >= 0)
        close(r->wfd);
    close(r->src);
    pthread_mutex_destroy(&r->mu);
    free(r);
}
