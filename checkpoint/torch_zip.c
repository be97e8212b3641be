/*
 * torch_zip.c - read a torch.save (PyTorch >= 1.6) zip archive: data.pkl
 * through the restricted unpickler (pickle.c), storages from its data/<key>
 * records through libtorch's zip reader (predictor/torch_backend.h). Kept
 * apart from pickle.c so the unpickler builds and fuzzes without libtorch.
 *
 * libtorch's reader inflates a record whole into memory, so a deflated record
 * that declares gigabytes (a zip bomb) would be inflated before anything
 * could check it. torch.save writes every record stored (uncompressed);
 * TorchScript deflates only its small code files. So the central directory
 * is read here first, and an archive with a stored record larger than the
 * file, or a compressed record that would inflate past ZIP_MAX_INFLATED, is
 * refused before libtorch reads any of it.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../predictor/torch_backend.h"
#include "formats.h"

#define ZIP_MAX_CENTRAL_DIR (64 << 20)
#define ZIP_MAX_INFLATED (16 << 20) /* bytes one compressed record may inflate to */

static uint64_t le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static md_status not_stored(md_err *err, const char *why)
{
    return md_err_set(err, MD_EUNPROC, "the checkpoint's zip archive %s; torch.save writes "
                      "records uncompressed, so re-save the file with torch.save instead of "
                      "re-zipping it", why);
}

/* Every central-directory entry is stored (method 0) and no larger than the
 * file, or compressed and inflates to at most ZIP_MAX_INFLATED. Handles zip64
 * (archives past 4 GiB, or entries marked so). */
static md_status check_records_stored(int fd, uint64_t file_size, md_err *err)
{
    uint8_t tail[65536 + 22];
    size_t tlen = file_size < sizeof tail ? (size_t)file_size : sizeof tail;
    if (pread(fd, tail, tlen, (off_t)(file_size - tlen)) != (ssize_t)tlen)
        return md_err_set(err, MD_EIO, "cannot read the checkpoint file");
    size_t eocd = SIZE_MAX;
    for (size_t i = tlen >= 22 ? tlen - 22 + 1 : 0; i-- > 0;)
        if (le(tail + i, 4) == 0x06054b50) {
            eocd = i;
            break;
        }
    if (eocd == SIZE_MAX)
        return not_stored(err, "has no end-of-central-directory record (truncated?)");
    uint64_t entries = le(tail + eocd + 10, 2), cd_size = le(tail + eocd + 12, 4),
             cd_off = le(tail + eocd + 16, 4);
    if (entries == 0xFFFF || cd_size == 0xFFFFFFFF || cd_off == 0xFFFFFFFF) {
        /* zip64: the locator just before the EOCD points at the zip64 EOCD */
        uint8_t z[56];
        if (eocd < 20 || le(tail + eocd - 20, 4) != 0x07064b50)
            return not_stored(err, "has a damaged zip64 directory");
        uint64_t z_off = le(tail + eocd - 20 + 8, 8);
        if (z_off > file_size || file_size - z_off < sizeof z ||
            pread(fd, z, sizeof z, (off_t)z_off) != (ssize_t)sizeof z ||
            le(z, 4) != 0x06064b50)
            return not_stored(err, "has a damaged zip64 directory");
        entries = le(z + 32, 8);
        cd_size = le(z + 40, 8);
        cd_off = le(z + 48, 8);
    }
    if (cd_off > file_size || cd_size > file_size - cd_off || cd_size > ZIP_MAX_CENTRAL_DIR)
        return not_stored(err, "has a central directory outside the file (truncated?)");
    uint8_t *cd = md_malloc_checked(cd_size ? (size_t)cd_size : 1, "zip directory", err);
    if (!cd)
        return MD_ENOMEM;
    md_status st = MD_OK;
    if (pread(fd, cd, (size_t)cd_size, (off_t)cd_off) != (ssize_t)cd_size)
        st = md_err_set(err, MD_EIO, "cannot read the checkpoint file");
    size_t at = 0;
    for (uint64_t e = 0; e < entries && st == MD_OK; e++) {
        if (cd_size - at < 46 || le(cd + at, 4) != 0x02014b50) {
            st = not_stored(err, "has a damaged central directory");
            break;
        }
        uint64_t method = le(cd + at + 10, 2), csize = le(cd + at + 20, 4),
                 usize = le(cd + at + 24, 4);
        size_t nlen = (size_t)le(cd + at + 28, 2), xlen = (size_t)le(cd + at + 30, 2),
               clen = (size_t)le(cd + at + 32, 2);
        if (cd_size - at - 46 < (uint64_t)nlen + xlen + clen) {
            st = not_stored(err, "has a damaged central directory");
            break;
        }
        const uint8_t *x = cd + at + 46 + nlen, *xend = x + xlen;
        while ((usize == 0xFFFFFFFF || csize == 0xFFFFFFFF) && xend - x >= 4) {
            size_t id = (size_t)le(x, 2), n = (size_t)le(x + 2, 2);
            if ((size_t)(xend - x - 4) < n)
                break;
            if (id == 1) { /* zip64 sizes: uncompressed, then compressed, when marked */
                const uint8_t *f = x + 4;
                if (usize == 0xFFFFFFFF && n >= 8) {
                    usize = le(f, 8);
                    f += 8;
                    n -= 8;
                }
                if (csize == 0xFFFFFFFF && n >= 8)
                    csize = le(f, 8);
                break;
            }
            x += 4 + n;
        }
        if (method != 0 && usize > ZIP_MAX_INFLATED)
            st = not_stored(err, "has a compressed record that would inflate past 16 MiB");
        else if (method == 0 && (usize != csize || usize > file_size))
            st = not_stored(err, "has a record larger than the file");
        at += 46 + nlen + xlen + clen;
    }
    free(cd);
    return st;
}

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

md_status md_ckpt_read_torch_zip(const char *path, md_tensors **out, md_err *err)
{
    *out = NULL;
    uint8_t head[16];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return md_err_set(err, MD_EIO, "cannot open the checkpoint file");
    ssize_t n = read(fd, head, sizeof head);
    struct stat sb;
    md_ckpt_format f = md_ckpt_sniff(head, n > 0 ? (size_t)n : 0);
    md_status st = MD_OK;
    if (f == MD_CKPT_LEGACY)
        st = md_err_set(err, MD_EUNPROC, "the checkpoint is in the legacy (pre-1.6) torch.save "
                        "format; re-save it with torch.save(..., "
                        "_use_new_zipfile_serialization=True)");
    else if (f != MD_CKPT_ZIP)
        st = md_err_set(err, MD_EUNPROC, "the checkpoint is not a zip archive, so not what "
                        "torch.save writes (nor a TorchScript archive)");
    else if (fstat(fd, &sb) < 0)
        st = md_err_set(err, MD_EIO, "cannot stat the checkpoint file");
    else
        st = check_records_stored(fd, (uint64_t)sb.st_size, err);
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
        st = md_ckpt_unpickle(pkl, len, storage_record, z, "the checkpoint", out, err);
    md_torch_zip_close(z);
    return st;
}
