/*
 * archive.c - md_archive_check: is an uploaded file a zip that libtorch may
 * open (a TorchScript archive or a torch.save file: every entry under one
 * top-level folder holding data.pkl)? Read from the zip's central directory
 * only, so it costs little whatever the size, and through md_zip_dir_read,
 * which reads the directory as libtorch's reader will and refuses records
 * that would make that reader allocate more than the file justifies: every
 * file in the store has passed it before libtorch opens it (the
 * predictor's load is the full check of the rest).
 */
#define _GNU_SOURCE
#include "checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "formats.h"

md_status md_archive_check(const char *path, md_err *err)
{
    static const char *fix = "send a TorchScript archive (torch.jit.save), a torch.save "
                             "state_dict or a safetensors file";
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return md_err_set(err, MD_EIO, "cannot read %s: %s", path, strerror(errno));
    unsigned char head[4];
    md_zip_dir *dir = NULL;
    md_status st = MD_OK;
    if (pread(fd, head, 4, 0) != 4 || memcmp(head, "PK\3\4", 4) != 0)
        st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                         "the checkpoint is not a model file (neither a zip archive, as "
                         "TorchScript and torch.save write, nor safetensors); %s",
                         fix);
    else
        st = md_zip_dir_read(fd, &dir, err);
    close(fd);
    if (st != MD_OK)
        return st;
    /* Every entry sits under one top-level folder, and <folder>/data.pkl exists. */
    char top[256] = "";
    size_t top_len = 0, entries = md_zip_dir_count(dir);
    int has_data = 0;
    for (size_t i = 0; i < entries && st == MD_OK; i++) {
        size_t nlen;
        const char *name = md_zip_dir_name(dir, i, &nlen);
        const char *slash = memchr(name, '/', nlen);
        if (!slash || (size_t)(slash - name) >= sizeof top) {
            st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                             "the checkpoint is a zip but not a PyTorch archive (entry "
                             "\"%.*s\" is not inside the archive folder); %s",
                             (int)(nlen > 100 ? 100 : nlen), name, fix);
            break;
        }
        size_t tl = (size_t)(slash - name);
        if (i == 0) {
            memcpy(top, name, tl);
            top_len = tl;
        } else if (top_len != tl || memcmp(top, name, tl) != 0) {
            st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                             "the checkpoint is a zip but not a PyTorch archive (entries in "
                             "several top-level folders); %s",
                             fix);
            break;
        }
        if (nlen - tl - 1 == 8 && memcmp(slash + 1, "data.pkl", 8) == 0)
            has_data = 1;
    }
    if (st == MD_OK && !has_data)
        st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                         "the checkpoint is a zip but not a PyTorch archive (%zu entries, no "
                         "data.pkl); %s",
                         entries, fix);
    md_zip_dir_free(dir);
    return st;
}
