/*
 * torch_backend.h - the only door to libtorch: a C header (it also compiles as
 * C++) over opaque handles; torch_backend.cpp implements it. Every function
 * catches every C++ exception and reports it through md_err.
 */
#ifndef MD_TORCH_BACKEND_H
#define MD_TORCH_BACKEND_H

#include "../config/md_err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The libtorch version this binary was built against, e.g. "1.13.1". Static string. */
const char *md_torch_version(void);

/* 1 when this build was made with CUDA support (WITH_CUDA=1), else 0. */
int md_torch_built_with_cuda(void);

#ifdef __cplusplus
}
#endif
#endif
