/*
 * formats.h - what training writes, read in C without running any code from
 * the file: torch.save zip archives (a restricted unpickler over data.pkl,
 * pickle.c and torch_zip.c) and safetensors files (safetensors.c, reader and
 * writer). Both produce an md_tensors: an ordered list of named tensors with
 * contiguous C-order data, plus a checkpoint's top-level numbers (epoch, loss)
 * and string metadata.
 *
 * Nothing here trusts a size from the file: every count, shape product and
 * offset goes through checked arithmetic and a limit before an allocation,
 * and every failure is an md_err naming the thing and the fix.
 *
 * Thread safety: every function is reentrant; an md_tensors is used by one
 * thread at a time (concurrent readers of an unchanging md_tensors are fine).
 */
#ifndef MD_CKPT_FORMATS_H
#define MD_CKPT_FORMATS_H

#include <stddef.h>
#include <stdint.h>

#include "../config/md_err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Limits, each overridable with -D at build time. */
#ifndef MD_CKPT_MAX_NDIM
#define MD_CKPT_MAX_NDIM 8 /* dimensions of one tensor */
#endif
#ifndef MD_CKPT_MAX_TENSORS
#define MD_CKPT_MAX_TENSORS 100000 /* tensors in one file (state_dict and skipped entries) */
#endif
#ifndef MD_CKPT_MAX_NAME
#define MD_CKPT_MAX_NAME 1024 /* bytes in a tensor name or a metadata key */
#endif
#ifndef MD_CKPT_MAX_TOTAL_BYTES
#define MD_CKPT_MAX_TOTAL_BYTES (16LL << 30) /* bytes of tensor data one read produces */
#endif
#ifndef MD_PICKLE_MAX_BYTES
#define MD_PICKLE_MAX_BYTES (64 << 20) /* size of data.pkl */
#endif
#ifndef MD_PICKLE_MAX_STACK
#define MD_PICKLE_MAX_STACK (1 << 16) /* values on the unpickler's stack */
#endif
#ifndef MD_PICKLE_MAX_MARKS
#define MD_PICKLE_MAX_MARKS 1024 /* nested MARKs (container nesting) */
#endif
#ifndef MD_PICKLE_MAX_MEMO
#define MD_PICKLE_MAX_MEMO (1 << 20) /* memo slots (BINPUT index + 1) */
#endif
#ifndef MD_PICKLE_MAX_STRING
#define MD_PICKLE_MAX_STRING (1 << 20) /* bytes in one pickled string */
#endif
#ifndef MD_PICKLE_MAX_ARENA
#define MD_PICKLE_MAX_ARENA (512LL << 20) /* memory for the unpickled objects */
#endif
#ifndef MD_ZIP_MAX_CENTRAL_DIR
#define MD_ZIP_MAX_CENTRAL_DIR (64 << 20) /* bytes of a zip's central directory */
#endif
#ifndef MD_ZIP_MAX_INFLATED
#define MD_ZIP_MAX_INFLATED (16 << 20) /* bytes one compressed zip record may inflate to */
#endif
#ifndef MD_ZIP_MAX_INFLATED_TOTAL
#define MD_ZIP_MAX_INFLATED_TOTAL (256LL << 20) /* ... all compressed records together */
#endif
#ifndef MD_SAFETENSORS_MAX_HEADER
/* bytes of a safetensors JSON header: the format allows 100 MB, but a header
 * is ~100 bytes a tensor (16 MiB: ~150k tensors, past any checkpoint), and
 * jansson may spend up to 20x it (safetensors.c): 320 MiB at most, not 2 GB */
#define MD_SAFETENSORS_MAX_HEADER (16LL << 20)
#endif

/* Element types of checkpoint tensors (the safetensors names in comments). */
typedef enum md_ckpt_dtype {
    MD_CKPT_F32 = 0, /* F32 */
    MD_CKPT_F16,     /* F16: IEEE half */
    MD_CKPT_BF16,    /* BF16 */
    MD_CKPT_F64,     /* F64 */
    MD_CKPT_I64,     /* I64 */
    MD_CKPT_I32,     /* I32 */
    MD_CKPT_I16,     /* I16 */
    MD_CKPT_I8,      /* I8 */
    MD_CKPT_U8,      /* U8 */
    MD_CKPT_BOOL,    /* BOOL: one byte, 0 or 1 */
    MD_CKPT_DTYPE_COUNT
} md_ckpt_dtype;

/* Bytes per element of `dtype`. */
size_t md_ckpt_dtype_size(md_ckpt_dtype dtype);
/* The safetensors name ("F32", ...). Static string. */
const char *md_ckpt_dtype_name(md_ckpt_dtype dtype);
/* 1 for F32/F16/BF16/F64 (what averaging mixes), else 0. */
int md_ckpt_dtype_is_float(md_ckpt_dtype dtype);

/* ---- named tensors ---- */

typedef struct md_tensors md_tensors;

/* A new empty list. Never fails (small allocation). */
md_tensors *md_tensors_new(void);
/* Free the list and every tensor's data. Accepts NULL. */
void md_tensors_free(md_tensors *t);

/* Append a tensor, copying `name`, `shape` and `nbytes` of `data` (which must
 * equal the product of `shape` times the element size, checked).
 * MD_ECONFLICT when the name is already there; MD_EINVAL for a bad shape or
 * size; MD_ETOOBIG past MD_CKPT_MAX_TENSORS / MD_CKPT_MAX_TOTAL_BYTES;
 * MD_ENOMEM when the copy cannot be allocated. */
md_status md_tensors_add(md_tensors *t, const char *name, md_ckpt_dtype dtype, int ndim,
                         const int64_t *shape, const void *data, size_t nbytes, md_err *err);

/* As md_tensors_add, but takes ownership of `data` (malloc'd, `nbytes`
 * long) even on failure, instead of copying it. */
md_status md_tensors_adopt(md_tensors *t, const char *name, md_ckpt_dtype dtype, int ndim,
                           const int64_t *shape, void *data, size_t nbytes, md_err *err);

size_t md_tensors_count(const md_tensors *t);
/* Index of `name`, or -1. */
long md_tensors_find(const md_tensors *t, const char *name);
/* Accessors of tensor `i` (< count). Pointers are borrowed, valid until the
 * list is freed. Data is contiguous, C order, native (little-endian) bytes. */
const char *md_tensors_name(const md_tensors *t, size_t i);
md_ckpt_dtype md_tensors_dtype(const md_tensors *t, size_t i);
int md_tensors_ndim(const md_tensors *t, size_t i);
const int64_t *md_tensors_shape(const md_tensors *t, size_t i);
const void *md_tensors_data(const md_tensors *t, size_t i);
size_t md_tensors_nbytes(const md_tensors *t, size_t i);
/* Mutable data of tensor `i` (averaging writes into a copy). */
void *md_tensors_data_mut(md_tensors *t, size_t i);

/* Top-level numbers of a checkpoint dict (`epoch`, `step`, `loss`; bools as
 * 0/1; one-element 0-dim tensors by value), in file order. Names borrowed. */
size_t md_tensors_scalar_count(const md_tensors *t);
const char *md_tensors_scalar_name(const md_tensors *t, size_t i);
double md_tensors_scalar_value(const md_tensors *t, size_t i);
/* Add or replace a number. */
void md_tensors_set_scalar(md_tensors *t, const char *name, double value);

/* String metadata (safetensors' __metadata__). Borrowed; NULL when absent. */
size_t md_tensors_meta_count(const md_tensors *t);
const char *md_tensors_meta_key(const md_tensors *t, size_t i);
const char *md_tensors_meta_value(const md_tensors *t, size_t i);
const char *md_tensors_meta_get(const md_tensors *t, const char *key);
/* Add or replace a metadata entry (copied). */
void md_tensors_set_meta(md_tensors *t, const char *key, const char *value);

/* `name` without a leading "module." (DistributedDataParallel's prefix), else
 * `name` itself. Borrowed from `name`. Strip when matching keys against an
 * architecture, never when reading: the file's names are reported as-is. */
const char *md_ckpt_strip_module(const char *name);

/* ---- reading tensor by tensor ---- */

/* What the *_each readers call once a tensor, in file order: `data`
 * (`nbytes`, contiguous C order, native bytes) is borrowed for the call
 * only, and NULL when the reader was asked for names and shapes alone
 * (`with_data` 0). Anything but MD_OK (with `err` set) stops the read with
 * that status. Unlike the readers into an md_tensors, duplicate names are
 * not refused here: the callee sees each one. */
typedef md_status (*md_ckpt_tensor_fn)(void *ctx, const char *name, md_ckpt_dtype dtype,
                                       int ndim, const int64_t *shape, const void *data,
                                       size_t nbytes, md_err *err);

/* One tensor of a file written piece by piece (md_safetensors_header). */
typedef struct md_ckpt_tensor_info {
    const char *name;
    md_ckpt_dtype dtype;
    int ndim;
    const int64_t *shape;
} md_ckpt_tensor_info;

/* ---- detecting a file's format ---- */

typedef enum md_ckpt_format {
    MD_CKPT_UNKNOWN = 0,
    MD_CKPT_ZIP,         /* a zip: TorchScript or torch.save; md_ckpt_zip_kind tells */
    MD_CKPT_SAFETENSORS, /* 8-byte header length then '{' */
    MD_CKPT_LEGACY,      /* pre-1.6 torch.save: a pickle starting with the magic number */
} md_ckpt_format;

/* The format of a file from its first bytes (16 are enough). */
md_ckpt_format md_ckpt_sniff(const uint8_t *head, size_t len);

/* ---- zip archives as libtorch reads them (zipdir.c) ---- */

/* A zip's central directory, checked. */
typedef struct md_zip_dir md_zip_dir;

/*
 * Read the central directory of the zip open at `fd` exactly as libtorch's
 * reader (PyTorchStreamReader, miniz) will, and check every entry against
 * what that reader would allocate for it: refused with MD_EUNPROC (codes
 * "zip_directories_disagree", "compressed_record_too_large",
 * "invalid_checkpoint") when the classic and zip64 end-of-central-directory
 * records disagree, when a record lies outside the file or shares bytes with
 * another, or when a compressed record would inflate past MD_ZIP_MAX_INFLATED
 * (all together past MD_ZIP_MAX_INFLATED_TOTAL). Call it before any libtorch
 * function opens the file. On success `*out` is a new directory the caller
 * frees with md_zip_dir_free. Reads with pread (the offset of `fd` is kept).
 */
md_status md_zip_dir_read(int fd, md_zip_dir **out, md_err *err);
size_t md_zip_dir_count(const md_zip_dir *z);
/* Entry `i`'s name (< count), `*len` bytes, not NUL-terminated; borrowed
 * until md_zip_dir_free. */
const char *md_zip_dir_name(const md_zip_dir *z, size_t i, size_t *len);
/* Accepts NULL. */
void md_zip_dir_free(md_zip_dir *z);

/* ---- torch.save (zip) ---- */

/* Where the unpickler gets a storage's bytes: `key` is the "data/<key>"
 * record's key. Returns the record's bytes, borrowed until the reader is done
 * (the callee owns them). MD_ENOTFOUND (with a message) when absent. */
typedef md_status (*md_ckpt_record_fn)(void *ctx, const char *key, const uint8_t **data,
                                       size_t *size, md_err *err);

/* A bound on the bytes of tensor data one read copies out, checked in
 * checked arithmetic before any tensor is allocated: a view's copy can be
 * far larger than the file (torch.zeros(1).expand(n) is one stored element
 * and n copied ones; a thousand names can view one storage). */
typedef struct md_ckpt_budget {
    unsigned long long max_bytes; /* 0, or past MD_CKPT_MAX_TOTAL_BYTES: that */
    const char *limit;            /* what sets it, for messages ("the
                                   * architecture's 67 elements"); NULL: the
                                   * build's MD_CKPT_MAX_TOTAL_BYTES */
} md_ckpt_budget;

/*
 * Read the state_dict pickled in `pkl` (a torch.save data.pkl), storages
 * through `record`. The file may be a state_dict (OrderedDict or dict of
 * tensors) or a dict holding one under "model", "state_dict" or
 * "model_state_dict" whose other entries are skipped (optimizer state is
 * parsed, checked and dropped) and whose top-level numbers become scalars.
 * No code from the file runs: only an allow-list of globals is accepted, and
 * any other fails with MD_EUNPROC naming it. `what` names the file in
 * messages. The state_dict's tensors together may copy out at most
 * `budget` bytes (NULL: MD_CKPT_MAX_TOTAL_BYTES), else MD_ETOOBIG (code
 * "checkpoint_too_large") naming the limit, before anything is copied. On
 * success `*out` is a new list the caller frees.
 */
md_status md_ckpt_unpickle(const uint8_t *pkl, size_t len, md_ckpt_record_fn record, void *ctx,
                           const char *what, const md_ckpt_budget *budget, md_tensors **out,
                           md_err *err);

/* Read a torch.save zip archive at `path` (data.pkl and data/<key> records,
 * read with libtorch's zip reader). A legacy (pre-1.6) file and a TorchScript
 * archive fail with MD_EUNPROC saying what to do; `budget` as md_ckpt_unpickle's.
 * The archive is checked with md_zip_dir_read before libtorch opens it. */
md_status md_ckpt_read_torch_zip(const char *path, const md_ckpt_budget *budget,
                                 md_tensors **out, md_err *err);
/* As md_ckpt_unpickle, but each state_dict tensor goes to `fn` as it is
 * copied out (at most one in memory), or without its data (`with_data` 0,
 * nothing copied). Top-level numbers are dropped. Each tensor and their sum
 * are bounded as md_ckpt_unpickle's with no budget given. */
md_status md_ckpt_unpickle_each(const uint8_t *pkl, size_t len, md_ckpt_record_fn record,
                                void *ctx, const char *what, int with_data, md_ckpt_tensor_fn fn,
                                void *fn_ctx, md_err *err);

/* The same archive's tensors one at a time (md_ckpt_unpickle_each): the
 * file is mapped, each storage read in place (every data/ record must be
 * stored, as torch.save writes them) and the mapped pages let go after each
 * tensor, so memory holds about one tensor, never the archive. */
md_status md_ckpt_each_torch_zip(const char *path, int with_data, md_ckpt_tensor_fn fn,
                                 void *ctx, md_err *err);

/* ---- safetensors ---- */

/* Parse a safetensors file held in `buf`: header length, JSON header, every
 * offset checked against the data, the data covered exactly once. Tensors in
 * data order; the data is copied. */
md_status md_safetensors_read(const uint8_t *buf, size_t len, md_tensors **out, md_err *err);
/* The same over the file at `path` (mapped, read, unmapped). */
md_status md_safetensors_read_file(const char *path, md_tensors **out, md_err *err);
/* Serialise `t` (every tensor, its metadata) as safetensors into a new
 * malloc'd buffer the caller frees. Names in list order, 8-byte aligned
 * header as the reference writer makes it. */
md_status md_safetensors_write(const md_tensors *t, uint8_t **buf, size_t *len, md_err *err);
/* The same written to `fd` (all of it, retrying short writes). */
md_status md_safetensors_write_fd(const md_tensors *t, int fd, md_err *err);
/* The tensors of the safetensors file at `path` one at a time, in data
 * order, checked as md_safetensors_read checks them: the file is mapped and
 * each tensor's pages let go after its call, so memory holds about one
 * tensor. */
md_status md_safetensors_each_file(const char *path, int with_data, md_ckpt_tensor_fn fn,
                                   void *ctx, md_err *err);
/* The first bytes of a safetensors file holding `count` tensors as `info`
 * says, in that order and back to back, and the metadata of `meta` (may be
 * NULL; its tensors are ignored): the 8-byte length and the JSON header,
 * padded as md_safetensors_write pads it, in a new buffer of *len bytes the
 * caller frees. Tensor i's data follows at *len plus the bytes of the ones
 * before it. */
md_status md_safetensors_header(const md_ckpt_tensor_info *info, size_t count,
                                const md_tensors *meta, uint8_t **out, size_t *len, md_err *err);

#ifdef __cplusplus
}
#endif
#endif
