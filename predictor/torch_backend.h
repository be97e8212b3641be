/*
 * torch_backend.h - the only door to libtorch: a C header (it also compiles as
 * C++) over opaque handles; torch_backend.cpp implements it. Every function
 * catches every C++ exception and reports it through md_err; a handle is
 * allocated only after everything that can throw has succeeded.
 *
 * Thread safety: md_torch_forward may run concurrently on one model from
 * several workers (TorchScript inference does not mutate the module).
 */
#ifndef MD_TORCH_BACKEND_H
#define MD_TORCH_BACKEND_H

#include <stdint.h>

#include "../config/md_err.h"
#include "../checkpoint/formats.h" /* md_ckpt_dtype (a type only; no link dependency) */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct md_torch_model md_torch_model;

/* Input dtypes a model may declare; inputs are cast to it before forward. */
typedef enum md_dtype { MD_F32 = 0, MD_F64, MD_I64, MD_U8, MD_I32, MD_BOOL } md_dtype;

/* The libtorch version this binary was built against, e.g. "1.13.1". Static string. */
const char *md_torch_version(void);

/* 1 when this build was made with CUDA support (WITH_CUDA=1), else 0. */
int md_torch_built_with_cuda(void);

/* CUDA devices usable now (0 on CPU-only builds or machines). */
int md_torch_cuda_device_count(void);

/* Process-wide set-up, once before any load: intra-op threads per forward,
 * and OpenBLAS held to one thread so workers do not oversubscribe cores. */
void md_torch_init(int intra_op_threads);

/* Load a TorchScript archive onto `device` ("cpu", "cuda", "cuda:N", "auto").
 * MD_EUNPROC with libtorch's message when the file does not load, or when
 * CUDA is asked for and unavailable. */
md_status md_torch_load(const char *path, const char *device, md_dtype input_dtype,
                        md_torch_model **out, md_err *err);

/* The device the model runs on, e.g. "cpu" or "cuda:0". Borrowed. */
const char *md_torch_device(const md_torch_model *m);

/*
 * Run forward on a float32 input of `ndim` dims `shape` (C order; shape[0]
 * is the batch). The input is cast to the model's declared dtype. On
 * success `*out` is a new malloc'd float32 buffer the caller frees, of shape
 * `out_shape[0..*out_ndim)` (at most 8 dims). A model returning a tuple or
 * list answers its first tensor. When it fails, `err` gets libtorch's reason
 * in one line, and libtorch's whole message (the TorchScript traceback),
 * when it says more, is logged as a warning.
 */
md_status md_torch_forward(md_torch_model *m, const float *input, const int64_t *shape, int ndim,
                           float **out, int64_t *out_shape, int *out_ndim, md_err *err);

/* As md_torch_forward, except that a failure does not log libtorch's whole
 * message (`err` holds the same reason): for a forward whose failure the
 * caller answers by running the input again (a batch of several requests
 * re-run in halves, a prepacked replica falling back on its base), so that
 * the forward that decides a request's answer is the one that logs, once. */
md_status md_torch_forward_quiet(md_torch_model *m, const float *input, const int64_t *shape,
                                 int ndim, float **out, int64_t *out_shape, int *out_ndim,
                                 md_err *err);

/* ---- several inputs and outputs (issue 27) ---- */

/* The most inputs or outputs a version may declare. */
#define MD_MAX_IO 16

/* One input of a batch, read from rows of 4-byte words: row r's values
 * start at base + r * row_words words, `values` of them per row, C order,
 * as float32 (1 word each) or, when is_int, as int64 (2 words each, native
 * byte order; the batcher moves rows as words, so an integer is never
 * rounded through float). The tensor forward gets is [rows, shape...] of
 * `dtype` (the values cast to it). */
typedef struct md_torch_in {
    const float *base;
    int64_t row_words;
    int is_int;
    md_dtype dtype;
    int ndim;              /* with the batch: shape[0] is the rows */
    const int64_t *shape;
} md_torch_in;

/* What forward returned, outputs side by side: row r of output j is
 * data[r * row_values + off[j] ..], values[j] floats (converted to float32
 * from whatever the model returned). shape[j] has the batch first. */
typedef struct md_torch_outs {
    int n;
    int ndim[MD_MAX_IO];
    int64_t shape[MD_MAX_IO][8];
    int64_t values[MD_MAX_IO], off[MD_MAX_IO];
    char dtype[MD_MAX_IO][12];  /* what the model returned: "float32", "int64", ... */
    int64_t row_values;
    float *data;                /* malloc'd; the caller frees it */
} md_torch_outs;

/*
 * Forward on n_in inputs (forward's arguments, in order) and pick n_out
 * outputs from what it returns: a dict by the names in keys[0..n_out); a
 * tuple or list by position (its first n_out elements; fewer is an error
 * naming keys[i]); a tensor when n_out is 1. Every output must keep the
 * batch dimension (MD_EUNPROC bad_model_output naming it). `quiet` as
 * md_torch_forward_quiet. On MD_OK *out holds the outputs.
 */
md_status md_torch_forward_io(md_torch_model *m, const md_torch_in *in, int n_in,
                              const char *const *keys, int n_out, int quiet, md_torch_outs *out,
                              md_err *err);

/* Mark the calling thread's forwards as background (batch job) work. On
 * CUDA, background threads use low-priority streams and the others
 * high-priority ones, so the GPU runs online kernels first; on the CPU the
 * batcher lowers the thread's nice instead, and this changes nothing. */
void md_torch_set_thread_background(int background);

/* Free a model. Accepts NULL. */
void md_torch_free(md_torch_model *m);

/* The bytes the model's parameters and buffers hold on its device, each
 * storage counted once (weights tied between layers share one): what the
 * loaded module keeps resident. Reads `m` only; safe beside forwards on it.
 * MD_EINTERNAL with libtorch's message if it throws. */
md_status md_torch_resident_bytes(const md_torch_model *m, size_t *out, md_err *err);

/*
 * A copy of `base` for ONE worker thread, frozen, with its linear layers
 * prepacked: each aten::linear of the forward graph's top-level block (not
 * inside an If or a Loop) whose weight is a float32 CPU constant runs as
 * XNNPACK's prepacked linear, behind an exact check of the input's width (weights packed
 * once here instead of by the BLAS on every call: 2-3x faster forwards at
 * 1-16 rows, ~10% at 64). The results differ from `base`'s by float
 * rounding, and a row's result no longer depends on the rows batched with
 * it. XNNPACK's prepacked operators keep per-call state, so a replica must
 * never be used by two threads at once: hence one per worker.
 * `*out` is NULL (MD_OK) when there is nothing to gain: a non-CPU model, no
 * such linear, or more than `max_weight_bytes` of such weights (each
 * replica holds its own packed copy); `*packed_bytes` says how many bytes
 * of weights were (or would have been) packed. MD_EUNPROC/MD_ENOMEM when
 * libtorch refuses: forward on `base` then. Reads `base` only (safe beside
 * forwards on it); calls on one `base` run one at a time, and once one found
 * nothing to pack (or failed) the later ones answer at once.
 */
md_status md_torch_replica(const md_torch_model *base, size_t max_weight_bytes,
                           md_torch_model **out, size_t *packed_bytes, md_err *err);

/* ---- training checkpoints (issue 12): zip records, architectures ---- */

/* A zip archive as libtorch reads it (caffe2::serialize::PyTorchStreamReader):
 * torch.save and TorchScript files. Records are named relative to the
 * archive's top folder ("data.pkl", "data/0", "version"). One thread at a
 * time per handle. */
typedef struct md_torch_zip md_torch_zip;

/* Open the zip at `path`. MD_EUNPROC with the reason when it is not one. */
md_status md_torch_zip_open(const char *path, md_torch_zip **out, md_err *err);
/* 1 when record `name` exists, else 0. */
int md_torch_zip_has_record(md_torch_zip *z, const char *name);
/* The bytes of record `name`, read once and cached: borrowed, valid until
 * md_torch_zip_close. MD_ENOTFOUND naming the record when absent. */
md_status md_torch_zip_record(md_torch_zip *z, const char *name, const uint8_t **data,
                              size_t *size, md_err *err);
/* Close the archive and free every record read. Accepts NULL. */
void md_torch_zip_close(md_torch_zip *z);

/* One named tensor: contiguous C-order data. Pointers borrowed. */
typedef struct md_torch_named_tensor {
    const char *name;
    md_ckpt_dtype dtype;
    int ndim;
    const int64_t *shape;
    const void *data;
} md_torch_named_tensor;

/*
 * Load the TorchScript architecture at `arch_path` as md_torch_load does
 * (device, input dtype) and set its parameters and buffers from `tensors`,
 * strictly, as PyTorch's load_state_dict(strict=True): keys the architecture
 * has and the tensors lack (missing), keys it does not have (unexpected),
 * and shape or kind (float vs integer) mismatches fail together with
 * MD_EUNPROC listing the first few of each and the counts. When every name
 * carries DistributedDataParallel's "module." prefix and stripping it makes
 * the keys match, it is stripped. F16/BF16/F64 become the parameter's dtype;
 * integer buffers (BatchNorm's num_batches_tracked) are copied as int64.
 * `tensors` are copied; on success `*out` is a new model for md_torch_forward.
 * Thread-safe (each call loads its own copy of the architecture).
 */
md_status md_torch_load_state(const char *arch_path, const char *device, md_dtype input_dtype,
                              const md_torch_named_tensor *tensors, size_t count,
                              md_torch_model **out, md_err *err);

/* md_torch_load_state's second half, on a model `m` from md_torch_load: set
 * its parameters and buffers from `tensors` strictly (the same checks and
 * errors). On failure `m` may hold some of the new values: free it. */
md_status md_torch_set_state(md_torch_model *m, const md_torch_named_tensor *tensors,
                             size_t count, md_err *err);

/* The elements of `m`'s parameters and buffers together: what a state_dict
 * that loads into it strictly holds, so a bound on what reading one may
 * allocate before it is matched. Reads `m` only (safe beside forwards). */
md_status md_torch_state_numel(const md_torch_model *m, int64_t *out, md_err *err);

/* A TorchScript module's parameters and buffers, in state_dict order, with
 * their values copied to the CPU: the architecture's table (name, shape,
 * dtype) and a TorchScript version's weights for export or averaging. */
typedef struct md_torch_state md_torch_state;

/* Read the parameters and buffers of the TorchScript archive at `path`
 * (the module's own tensors, copied only where not already contiguous).
 * MD_EUNPROC when it does not load or holds a dtype the checkpoint formats
 * cannot express (complex, quantized). */
md_status md_torch_state_read(const char *path, md_torch_state **out, md_err *err);
/* As md_torch_state_read, but only the table: names, shapes and dtypes, the
 * data NULL. The archive is loaded onto libtorch's meta device, so its
 * tensors are read one at a time and dropped (about the largest one in
 * memory, not the whole archive); an archive that does not load so is
 * loaded as md_torch_state_read does. */
md_status md_torch_state_read_shapes(const char *path, md_torch_state **out, md_err *err);
size_t md_torch_state_count(const md_torch_state *s);
/* Entry `i` (< count): pointers borrowed until md_torch_state_free (data NULL
 * from md_torch_state_read_shapes); `*is_buffer` (may be NULL) is 1 for a
 * buffer, 0 for a parameter. */
void md_torch_state_get(const md_torch_state *s, size_t i, md_torch_named_tensor *out,
                        int *is_buffer);
/* Accepts NULL. */
void md_torch_state_free(md_torch_state *s);

/* Convert `count` elements at `src` of dtype `from` into `dst` (room for
 * `count` elements of `to`), rounding as PyTorch's Tensor.to(dtype) does
 * (float16/bfloat16/float64 weights into a float32 architecture). MD_EINVAL
 * for an unknown dtype. Thread-safe. */
md_status md_torch_cast(const void *src, md_ckpt_dtype from, void *dst, md_ckpt_dtype to,
                        size_t count, md_err *err);

#ifdef __cplusplus
}
#endif
#endif
