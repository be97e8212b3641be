/*
 * archive.c - md_archive_check: is an uploaded zip a PyTorch archive (a zip
 * whose entries sit under one top-level folder holding data.pkl), as both
 * torch.jit.save (TorchScript) and torch.save write it? Read
 * from the zip's central directory only, so it costs little whatever the
 * size; the predictor's load is the full check.
 */
#define _GNU_SOURCE
#include "checkpoint.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

static unsigned rd16(const unsigned char *p) { return (unsigned)p[0] | (unsigned)p[1] << 8; }
static unsigned long rd32(const unsigned char *p)
{
    return (unsigned long)p[0] | (unsigned long)p[1] << 8 | (unsigned long)p[2] << 16 |
           (unsigned long)p[3] << 24;
}

md_status md_archive_check(const char *path, md_err *err)
{
    static const char *fix = "send a TorchScript archive (torch.jit.save), a torch.save "
                             "state_dict or a safetensors file";
    FILE *f = fopen(path, "rb");
    if (!f)
        return md_err_set(err, MD_EIO, "cannot read %s: %s", path, strerror(errno));
    md_status st = MD_OK;
    unsigned char head[4];
    unsigned char *tail = NULL, *cd = NULL;
    if (fread(head, 1, 4, f) != 4 || memcmp(head, "PK\3\4", 4) != 0) {
        st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                         "the checkpoint is not a model file (neither a zip archive, as "
                         "TorchScript and torch.save write, nor safetensors); %s",
                         fix);
        goto out;
    }
    /* The end-of-central-directory record is in the last 65557 bytes. */
    fseeko(f, 0, SEEK_END);
    off_t fsize = ftello(f);
    long tail_len = fsize < 65557 ? (long)fsize : 65557;
    tail = md_xmalloc((size_t)tail_len);
    fseeko(f, fsize - tail_len, SEEK_SET);
    if (fread(tail, 1, (size_t)tail_len, f) != (size_t)tail_len) {
        st = md_err_set(err, MD_EIO, "cannot read %s", path);
        goto out;
    }
    long eocd = -1;
    for (long i = tail_len - 22; i >= 0; i--)
        if (rd32(tail + i) == 0x06054b50UL) {
            eocd = i;
            break;
        }
    if (eocd < 0) {
        st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                         "the checkpoint is a damaged zip archive (truncated: no central "
                         "directory); %s",
                         fix);
        goto out;
    }
    unsigned long cd_size = rd32(tail + eocd + 12), cd_off = rd32(tail + eocd + 16);
    if (cd_size == 0xffffffffUL || cd_off == 0xffffffffUL)
        goto out; /* zip64: a very large archive; the predictor's load is the real check */
    if ((off_t)(cd_off + cd_size) > fsize || cd_size > 64UL * 1024 * 1024) {
        st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                         "the checkpoint is a damaged zip archive (corrupt central directory); %s",
                         fix);
        goto out;
    }
    cd = md_xmalloc(cd_size ? cd_size : 1);
    fseeko(f, (off_t)cd_off, SEEK_SET);
    if (fread(cd, 1, cd_size, f) != cd_size) {
        st = md_err_set(err, MD_EIO, "cannot read %s", path);
        goto out;
    }
    /* Every entry sits under one top-level folder, and <folder>/data.pkl exists. */
    char top[256] = "";
    int has_data = 0, entries = 0;
    for (unsigned long p = 0; p + 46 <= cd_size;) {
        if (rd32(cd + p) != 0x02014b50UL)
            break;
        unsigned nlen = rd16(cd + p + 28), xlen = rd16(cd + p + 30), clen = rd16(cd + p + 32);
        if (p + 46 + nlen > cd_size)
            break;
        const char *name = (const char *)cd + p + 46;
        const char *slash = memchr(name, '/', nlen);
        if (!slash || (size_t)(slash - name) >= sizeof top) {
            st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                             "the checkpoint is a zip but not a PyTorch archive (entry "
                             "\"%.*s\" is not inside the archive folder); %s",
                             (int)(nlen > 100 ? 100 : nlen), name, fix);
            goto out;
        }
        size_t tl = (size_t)(slash - name);
        if (!top[0]) {
            memcpy(top, name, tl);
            top[tl] = '\0';
        } else if (strlen(top) != tl || memcmp(top, name, tl) != 0) {
            st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                             "the checkpoint is a zip but not a PyTorch archive (entries in "
                             "several top-level folders); %s",
                             fix);
            goto out;
        }
        if (nlen - tl - 1 == 8 && memcmp(slash + 1, "data.pkl", 8) == 0)
            has_data = 1;
        entries++;
        p += 46 + nlen + xlen + clen;
    }
    if (!has_data)
        st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                         "the checkpoint is a zip but not a PyTorch archive (%d entries, no "
                         "data.pkl); %s",
                         entries, fix);
out:
    free(tail);
    free(cd);
    fclose(f);
    return st;
}
