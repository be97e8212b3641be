/*
 * zipdir.c - md_zip_dir: a zip archive's central directory read the way
 * libtorch's reader (caffe2::serialize::PyTorchStreamReader over miniz)
 * reads it, checked before libtorch opens the file.
 *
 * DESIGN
 * libtorch inflates a record whole into a buffer of the size the central
 * directory declares, so whatever that directory says is what libtorch
 * allocates; a check is worth something only if it reads the *same*
 * directory. A zip can describe itself twice: the classic end-of-central-
 * directory record (EOCD) and, when a zip64 locator sits right before it, a
 * zip64 EOCD, which miniz prefers whenever it is there, while a reader that
 * looks at the classic record only sees another archive (issue 24: a harmless
 * classic directory, a zip64 one holding a deflated 4.7 GB data/0). So this
 * reader follows miniz's choices step by step (the last EOCD signature in the
 * file's tail; the zip64 record when the locator is there; `entries` entries
 * from the directory's offset; zip64 extra fields when a 32-bit field is
 * saturated) and, where miniz would quietly pick one of two readings, refuses
 * instead: two EOCD records that disagree, a locator whose record is
 * missing, a saturated size without its zip64 field. Then every entry, not
 * only the ones modeld will ask for, is bounded: a stored record is no larger
 * than the file and lies inside it, a deflated one inflates to at most
 * MD_ZIP_MAX_INFLATED, all deflated ones together to MD_ZIP_MAX_INFLATED_TOTAL,
 * and the records' bytes together fit in the file (no two records share
 * bytes, so N names cannot make libtorch hold N copies of one region).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "formats.h"

#define SIG_LOCAL 0x04034b50u
#define SIG_CENTRAL 0x02014b50u
#define SIG_EOCD 0x06054b50u
#define SIG_ZIP64_EOCD 0x06064b50u
#define SIG_ZIP64_LOCATOR 0x07064b50u
#define EOCD_SIZE 22
#define ZIP64_EOCD_SIZE 56
#define ZIP64_LOCATOR_SIZE 20
#define CENTRAL_SIZE 46
#define LOCAL_SIZE 30

struct md_zip_dir {
    uint8_t *cd; /* the central directory's bytes */
    size_t count;
    size_t *name_at; /* offset in cd of each entry's name */
    uint16_t *name_len;
};

static const char refit[] = "re-save the file with torch.save or torch.jit.save instead of "
                            "editing or re-zipping it";

static uint64_t le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static md_status damaged(md_err *err, const char *why)
{
    return md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                       "the checkpoint's zip archive %s; %s", why, refit);
}

/* A printable copy of an entry name for a message (names are client bytes). */
static const char *printable(const uint8_t *s, size_t len, char *out, size_t size)
{
    size_t o = 0;
    for (size_t i = 0; i < len && o + 5 < size; i++) {
        if (s[i] >= 0x20 && s[i] < 0x7f && s[i] != '"' && s[i] != '\\')
            out[o++] = (char)s[i];
        else
            o += (size_t)snprintf(out + o, size - o, "\\x%02x", s[i]);
    }
    out[o] = 0;
    return out;
}

static int pread_all(int fd, void *buf, size_t n, uint64_t off)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, (uint8_t *)buf + got, n - got, (off_t)(off + got));
        if (r <= 0)
            return -1;
        got += (size_t)r;
    }
    return 0;
}

/* Where the directory is and how many entries it has, as miniz finds them. */
typedef struct dir_pos {
    uint64_t entries, cd_size, cd_off;
} dir_pos;

static md_status locate(int fd, uint64_t file_size, dir_pos *pos, md_err *err)
{
    uint8_t tail[65535 + EOCD_SIZE];
    if (file_size < EOCD_SIZE)
        return damaged(err, "is too short to hold an end-of-central-directory record");
    size_t tlen = file_size < sizeof tail ? (size_t)file_size : sizeof tail;
    uint64_t tail_off = file_size - tlen;
    if (pread_all(fd, tail, tlen, tail_off) < 0)
        return md_err_set(err, MD_EIO, "cannot read the checkpoint file");
    /* miniz: the last signature with a whole record after it */
    size_t at = SIZE_MAX;
    for (size_t i = tlen - EOCD_SIZE + 1; i-- > 0;)
        if (le(tail + i, 4) == SIG_EOCD) {
            at = i;
            break;
        }
    if (at == SIZE_MAX)
        return damaged(err, "has no end-of-central-directory record (truncated?)");
    const uint8_t *e = tail + at;
    uint64_t eocd_off = tail_off + at;
    uint64_t disk = le(e + 4, 2), cd_disk = le(e + 6, 2), on_disk = le(e + 8, 2),
             entries = le(e + 10, 2), cd_size = le(e + 12, 4), cd_off = le(e + 16, 4);
    uint8_t loc[ZIP64_LOCATOR_SIZE];
    int zip64 = eocd_off >= ZIP64_LOCATOR_SIZE &&
                pread_all(fd, loc, sizeof loc, eocd_off - ZIP64_LOCATOR_SIZE) == 0 &&
                le(loc, 4) == SIG_ZIP64_LOCATOR;
    if (zip64) {
        /* miniz takes the zip64 record whenever the locator points at one */
        uint8_t z[ZIP64_EOCD_SIZE];
        uint64_t z_off = le(loc + 8, 8);
        if (le(loc + 4, 4) != 0 || le(loc + 16, 4) != 1)
            return damaged(err, "spans several disks");
        if (z_off > eocd_off - ZIP64_LOCATOR_SIZE ||
            eocd_off - ZIP64_LOCATOR_SIZE - z_off < ZIP64_EOCD_SIZE ||
            pread_all(fd, z, sizeof z, z_off) < 0 || le(z, 4) != SIG_ZIP64_EOCD ||
            le(z + 4, 8) < ZIP64_EOCD_SIZE - 12)
            return damaged(err, "has a zip64 locator but no valid zip64 end-of-central-"
                                "directory record");
        uint64_t z_disk = le(z + 16, 4), z_cd_disk = le(z + 20, 4), z_on_disk = le(z + 24, 8),
                 z_entries = le(z + 32, 8), z_cd_size = le(z + 40, 8), z_cd_off = le(z + 48, 8);
        /* a classic field is either saturated (look in the zip64 record) or
         * the same number; anything else is two archives in one file */
        if ((disk != 0xFFFF && disk != z_disk) || (cd_disk != 0xFFFF && cd_disk != z_cd_disk) ||
            (on_disk != 0xFFFF && on_disk != z_on_disk) ||
            (entries != 0xFFFF && entries != z_entries) ||
            (cd_size != 0xFFFFFFFF && cd_size != z_cd_size) ||
            (cd_off != 0xFFFFFFFF && cd_off != z_cd_off))
            return md_err_setc(err, MD_EUNPROC, "zip_directories_disagree",
                               "the checkpoint's zip archive has two end-of-central-directory "
                               "records that disagree: the classic one lists %llu entries at "
                               "byte %llu, the zip64 one %llu entries at byte %llu. Zip readers "
                               "differ in which one they trust (libtorch takes the zip64 one), "
                               "so the file is refused; %s",
                               (unsigned long long)entries, (unsigned long long)cd_off,
                               (unsigned long long)z_entries, (unsigned long long)z_cd_off, refit);
        disk = z_disk;
        cd_disk = z_cd_disk;
        on_disk = z_on_disk;
        entries = z_entries;
        cd_size = z_cd_size;
        cd_off = z_cd_off;
    } else if (cd_size == 0xFFFFFFFF || cd_off == 0xFFFFFFFF) {
        return damaged(err, "marks its directory as zip64 but has no zip64 record");
    }
    if (disk != 0 || cd_disk != 0 || on_disk != entries)
        return damaged(err, "spans several disks");
    if (cd_size > MD_ZIP_MAX_CENTRAL_DIR)
        return md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                           "the checkpoint's zip directory is %llu bytes; the limit is %d "
                           "(MD_ZIP_MAX_CENTRAL_DIR)",
                           (unsigned long long)cd_size, MD_ZIP_MAX_CENTRAL_DIR);
    if (cd_off > file_size || cd_size > file_size - cd_off || entries > cd_size / CENTRAL_SIZE)
        return damaged(err, "has a central directory outside the file (truncated?)");
    pos->entries = entries;
    pos->cd_size = cd_size;
    pos->cd_off = cd_off;
    return MD_OK;
}

/* Entry sizes after the zip64 extra field, as mz_zip_file_stat_internal reads
 * it: consulted when any of the three 32-bit fields is saturated, each 64-bit
 * value present only for a saturated field, in this order. */
static int zip64_sizes(const uint8_t *x, size_t xlen, uint64_t *usize, uint64_t *csize,
                       uint64_t *local_off)
{
    while (xlen >= 4) {
        size_t id = (size_t)le(x, 2), n = (size_t)le(x + 2, 2);
        if (n > xlen - 4)
            return -1;
        if (id == 1) {
            const uint8_t *f = x + 4;
            uint64_t *fields[3] = {usize, csize, local_off};
            for (int k = 0; k < 3; k++) {
                if (*fields[k] != 0xFFFFFFFF)
                    continue;
                if (n < 8)
                    return -1;
                *fields[k] = le(f, 8);
                f += 8;
                n -= 8;
            }
            return 0;
        }
        x += 4 + n;
        xlen -= 4 + n;
    }
    return -1;
}

md_status md_zip_dir_read(int fd, md_zip_dir **out, md_err *err)
{
    *out = NULL;
    struct stat sb;
    if (fstat(fd, &sb) < 0)
        return md_err_set(err, MD_EIO, "cannot stat the checkpoint file");
    uint64_t file_size = (uint64_t)sb.st_size;
    dir_pos pos;
    md_status st = locate(fd, file_size, &pos, err);
    if (st != MD_OK)
        return st;
    md_zip_dir *z = md_xcalloc(1, sizeof *z);
    z->cd = md_malloc_checked(pos.cd_size ? (size_t)pos.cd_size : 1, "zip directory", err);
    z->name_at = md_mallocarray_checked(pos.entries ? (size_t)pos.entries : 1,
                                        sizeof *z->name_at, "zip directory", err);
    z->name_len = md_mallocarray_checked(pos.entries ? (size_t)pos.entries : 1,
                                         sizeof *z->name_len, "zip directory", err);
    if (!z->cd || !z->name_at || !z->name_len) {
        md_zip_dir_free(z);
        return MD_ENOMEM;
    }
    if (pread_all(fd, z->cd, (size_t)pos.cd_size, pos.cd_off) < 0) {
        md_zip_dir_free(z);
        return md_err_set(err, MD_EIO, "cannot read the checkpoint file");
    }
    const uint8_t *cd = z->cd;
    size_t at = 0;
    uint64_t on_disk = 0, inflated = 0;
    char q[160];
    for (uint64_t e = 0; e < pos.entries && st == MD_OK; e++) {
        if (pos.cd_size - at < CENTRAL_SIZE || le(cd + at, 4) != SIG_CENTRAL) {
            st = damaged(err, "has a damaged central directory");
            break;
        }
        const uint8_t *h = cd + at;
        uint64_t flags = le(h + 8, 2), method = le(h + 10, 2), csize = le(h + 20, 4),
                 usize = le(h + 24, 4), local_off = le(h + 42, 4);
        size_t nlen = (size_t)le(h + 28, 2), xlen = (size_t)le(h + 30, 2),
               clen = (size_t)le(h + 32, 2);
        if (pos.cd_size - at - CENTRAL_SIZE < (uint64_t)nlen + xlen + clen) {
            st = damaged(err, "has a damaged central directory");
            break;
        }
        const uint8_t *name = h + CENTRAL_SIZE;
        printable(name, nlen, q, sizeof q);
        if ((usize == 0xFFFFFFFF || csize == 0xFFFFFFFF || local_off == 0xFFFFFFFF) &&
            zip64_sizes(name + nlen, xlen, &usize, &csize, &local_off) < 0) {
            st = damaged(err, "has an entry whose zip64 sizes are missing or damaged");
            break;
        }
        if (flags & 1) {
            st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                             "the checkpoint's zip archive has an encrypted record (\"%s\"); %s",
                             q, refit);
            break;
        }
        if (method != 0 && method != 8) {
            st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                             "the checkpoint's zip archive has a record (\"%s\") compressed "
                             "with method %llu; only stored and deflated records are read; %s",
                             q, (unsigned long long)method, refit);
            break;
        }
        if (local_off > file_size || file_size - local_off < LOCAL_SIZE ||
            csize > file_size - local_off - LOCAL_SIZE ||
            __builtin_add_overflow(on_disk, csize + LOCAL_SIZE, &on_disk) ||
            on_disk > file_size) {
            st = damaged(err, "has records that lie outside the file or share its bytes");
            break;
        }
        if (method == 0 && usize != csize) {
            st = damaged(err, "has a stored record whose two sizes differ");
            break;
        }
        if (method == 8 &&
            (usize > MD_ZIP_MAX_INFLATED ||
             __builtin_add_overflow(inflated, usize, &inflated) ||
             inflated > (uint64_t)MD_ZIP_MAX_INFLATED_TOTAL)) {
            st = md_err_setc(err, MD_EUNPROC, "compressed_record_too_large",
                             "the checkpoint's zip archive has a compressed record that would "
                             "inflate past %d MiB (\"%s\" declares %llu bytes; all compressed "
                             "records together may inflate to %lld MiB, MD_ZIP_MAX_INFLATED and "
                             "MD_ZIP_MAX_INFLATED_TOTAL); torch.save writes tensors "
                             "uncompressed and torch.jit.save compresses only small code "
                             "files: %s",
                             MD_ZIP_MAX_INFLATED >> 20, q, (unsigned long long)usize,
                             (long long)(MD_ZIP_MAX_INFLATED_TOTAL >> 20), refit);
            break;
        }
        z->name_at[z->count] = at + CENTRAL_SIZE;
        z->name_len[z->count] = (uint16_t)nlen;
        z->count++;
        at += CENTRAL_SIZE + nlen + xlen + clen;
    }
    if (st != MD_OK) {
        md_zip_dir_free(z);
        return st;
    }
    *out = z;
    return MD_OK;
}

size_t md_zip_dir_count(const md_zip_dir *z) { return z->count; }

const char *md_zip_dir_name(const md_zip_dir *z, size_t i, size_t *len)
{
    *len = z->name_len[i];
    return (const char *)z->cd + z->name_at[i];
}

void md_zip_dir_free(md_zip_dir *z)
{
    if (!z)
        return;
    free(z->cd);
    free(z->name_at);
    free(z->name_len);
    free(z);
}
