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
 * list answers its first tensor.
 */
md_status md_torch_forward(md_torch_model *m, const float *input, const int64_t *shape, int ndim,
                           float **out, int64_t *out_shape, int *out_ndim, md_err *err);

/* Mark the calling thread's forwards as background (batch job) work. On
 * CUDA, background threads use low-priority streams and the others
 * high-priority ones, so the GPU runs online kernels first; on the CPU the
 * batcher lowers the thread's nice instead, and this changes nothing. */
void md_torch_set_thread_background(int background);

/* Free a model. Accepts NULL. */
void md_torch_free(md_torch_model *m);

#ifdef __cplusplus
}
#endif
#endif
