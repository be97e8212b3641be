/*
 * predictor.h - what the predictor knows about a model version's settings.
 *
 * Per-version config, given at deploy:
 *   input {shape: [d...], dtype: float32|float64|int64|uint8}
 *   preprocess {scale, mean: [], std: []}   (torchvision ToTensor + Normalize)
 *   output: logits | probabilities | raw
 *   labels: ["class", ...]
 *   batching {max_batch_size, max_delay_us, queue_limit, timeout_ms}
 *   workers, device: cpu | cuda | cuda:N | auto
 * Thread-safe: pure functions of their arguments.
 */
#ifndef MD_PREDICTOR_H
#define MD_PREDICTOR_H

#include <jansson.h>

#include "../config/md_err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Check a version config object; MD_EUNPROC naming the key and what is
 * allowed when a key is unknown or a value is wrong. NULL is a valid {}. */
md_status md_model_config_check(json_t *config, md_err *err);

#ifdef __cplusplus
}
#endif
#endif
