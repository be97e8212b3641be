/*
 * torch_zip.c - read a torch.save (PyTorch >= 1.6) zip archive: data.pkl
 * through the restricted unpickler (pickle.c), storages from its data/<key>
 * records through libtorch's zip reader (predictor/torch_backend.h). Kept
 * apart from pickle.c so the unpickler builds and fuzzes without libtorch.
 *
 * libtorch's reader inflates a record whole into memory, so a deflated record
 * that declares gigabytes (a zip bomb) would be inflated before anything
 * could check it. So the central directory is read first, as libtorch will
 * read it (md_zip_dir_read, zipdir.c), and an archive with a record outside
 * the file or one that would inflate past MD_ZIP_MAX_INFLATED is refused
 * before libtorch reads any of it.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../predictor/torch_backend.h"
#include "formats.h"

static md_status storage_record(void *ctx, const char *key, const uint8_t **data, size_t *size,
                                md_err *err)
{
    char name[96];
    snprintf(name, sizeof name, "data/%s", key);
    md_status st = md_torch_zip_record(ctx, name, data, size, err);
    if (st == MD_ENOTFOUND)
        return md_err_set(err, MD_EUNPROC, "the checkpoint's data.pkl names storage %s, which "
                          "the archive does not hold; the file is truncated or corrupt", name);
    return st;
}

md_status md_ckpt_read_torch_zip(const char *path, const md_ckpt_budget *budget,
                                 md_tensors **out, md_err *err)
{
    *out = NULL;
    uint8_t head[16];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return md_err_set(err, MD_EIO, "cannot open the checkpoint file");
    ssize_t n = read(fd, head, sizeof head);
    md_ckpt_format f = md_ckpt_sniff(head, n > 0 ? (size_t)n : 0);
    md_status st = MD_OK;
    if (f == MD_CKPT_LEGACY)
        st = md_err_set(err, MD_EUNPROC, "the checkpoint is in the legacy (pre-1.6) torch.save "
                        "format; re-save it with torch.save(..., "
                        "_use_new_zipfile_serialization=True)");
    else if (f != MD_CKPT_ZIP)
        st = md_err_set(err, MD_EUNPROC, "the checkpoint is not a zip archive, so not what "
                        "torch.save writes (nor a TorchScript archive)");
    else {
        md_zip_dir *dir = NULL;
        st = md_zip_dir_read(fd, &dir, err);
        md_zip_dir_free(dir);
    }
    close(fd);
    if (st != MD_OK)
        return st;
    md_torch_zip *z = NULL;
    st = md_torch_zip_open(path, &z, err);
    if (st != MD_OK)
        return st;
    const uint8_t *pkl = NULL;
    size_t len = 0;
    if (md_torch_zip_has_record(z, "constants.pkl") || md_torch_zip_has_record(z, "code/"))
        st = md_err_set(err, MD_EUNPROC, "the file is a TorchScript archive, not a torch.save "
                        "checkpoint");
    else if (!md_torch_zip_has_record(z, "data.pkl"))
        st = md_err_set(err, MD_EUNPROC, "the zip archive has no data.pkl, so it is not what "
                        "torch.save writes");
    else
        st = md_torch_zip_record(z, "data.pkl", &pkl, &len, err);
    if (st == MD_OK)
        st = md_ckpt_unpickle(pkl, len, storage_record, z, "the checkpoint", budget, out,
                              err);
    md_torch_zip_close(z);
    return st;
}
