/*
 * tensor_internal.h - what the request-body decoders of predictor/ share
 * (tensor.c, npy.c, v2.c); private to predictor/, predictor.h stays the
 * folder's interface.
 */
#ifndef MD_TENSOR_INTERNAL_H
#define MD_TENSOR_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "predictor.h"

/* The index of the first NaN or infinity among `count` floats, or `count`. */
size_t md_first_not_finite(const float *buf, size_t count);

/* IEEE half-precision bits to float, exactly (v2.c; npz.c reads float16
 * members with it). Infinities and NaN stay what they are. */
float md_half_to_float(uint16_t h);

/* The JSON row scanner over [p, end) starting at an array ('[' after blanks):
 * the rows into *out (owned by the caller on MD_OK, cleared otherwise), at
 * most max_values numbers; *stop is where the scan stopped (after the array
 * on MD_OK). Errors are 400s naming the problem, as md_tensor_decode's. */
md_status md_tensor_scan_rows(const char *p, const char *end, size_t max_values, md_tensor *out,
                              const char **stop, md_err *err);

#endif
