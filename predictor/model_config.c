/* model_config.c - validation of per-version model config (see predictor.h). */
#include <stdio.h>
#include <string.h>

#include "predictor.h"

static md_status bad(md_err *err, const char *key, const char *allowed)
{
    return md_err_setc(err, MD_EUNPROC, "invalid_config", "config.%s is invalid; %s", key,
                       allowed);
}

static int is_num(json_t *v) { return json_is_integer(v) || json_is_real(v); }

static int int_in(json_t *v, json_int_t lo, json_int_t hi)
{
    return json_is_integer(v) && json_integer_value(v) >= lo && json_integer_value(v) <= hi;
}

static md_status check_num_array(json_t *a, const char *key, int positive, md_err *err)
{
    size_t i;
    json_t *x;
    if (!json_is_array(a) || json_array_size(a) == 0)
        return bad(err, key, "give a non-empty array of numbers, one per channel");
    json_array_foreach(a, i, x)
    {
        if (!is_num(x) || (positive && json_number_value(x) <= 0))
            return bad(err, key, positive ? "every value must be a number > 0"
                                          : "every value must be a number");
    }
    return MD_OK;
}

static int io_name_ok(const char *n)
{
    size_t len = strlen(n);
    if (len == 0 || len >= MD_IO_NAME_MAX)
        return 0;
    for (const char *p = n; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '_' || *p == '.' || *p == '-'))
            return 0;
    return 1;
}

static md_status io_bad(md_err *err, const char *list, size_t i, const char *name,
                        const char *what)
{
    if (name)
        return md_err_setc(err, MD_EUNPROC, "invalid_config", "config.%s[%zu] (\"%s\"): %s",
                           list, i, name, what);
    return md_err_setc(err, MD_EUNPROC, "invalid_config", "config.%s[%zu]: %s", list, i, what);
}

/* config.inputs or config.outputs: an array of {"name", ...}, names unique. */
static md_status check_io(json_t *v, const char *list, md_err *err)
{
    int inputs = strcmp(list, "inputs") == 0;
    if (!json_is_array(v) || json_array_size(v) == 0 || json_array_size(v) > MD_MAX_IO)
        return md_err_setc(err, MD_EUNPROC, "invalid_config",
                           "config.%s is invalid; give 1 to %d objects such as {\"name\": "
                           "\"%s\"%s}, in the order %s",
                           list, MD_MAX_IO, inputs ? "features" : "logits",
                           inputs ? ", \"shape\": [4], \"dtype\": \"float32\"" : "",
                           inputs ? "forward takes them" : "forward returns them (or its "
                                                           "dict's keys)");
    size_t i;
    json_t *e;
    int marked = 0;
    json_array_foreach(v, i, e)
    {
        const char *name = json_string_value(json_object_get(e, "name"));
        if (!json_is_object(e) || !name)
            return io_bad(err, list, i, NULL, "give an object with a \"name\"");
        if (!io_name_ok(name))
            return io_bad(err, list, i, name,
                          "a name is 1 to 63 letters, digits, '_', '.' or '-'");
        static const char *const taken[] = {"index", "path", "prediction", "label", "scores",
                                            NULL};
        for (const char *const *t = taken; !inputs && *t; t++)
            if (strcmp(name, *t) == 0)
                return io_bad(err, list, i, name,
                              "the name is a field of every job's output (index, path, "
                              "prediction, label, scores): choose another");
        for (size_t k = 0; k < i; k++)
            if (strcmp(json_string_value(json_object_get(json_array_get(v, k), "name")), name) ==
                0)
                return io_bad(err, list, i, name, "the name is given twice; names are unique");
        const char *key;
        json_t *x;
        json_object_foreach(e, key, x)
        {
            if (strcmp(key, "name") == 0)
                continue;
            if (strcmp(key, "shape") == 0) {
                size_t d;
                json_t *dim;
                if (!json_is_array(x) || json_array_size(x) > 7)
                    return io_bad(err, list, i, name,
                                  "shape is the shape of one row without the batch "
                                  "dimension: 0 to 7 integers >= 1 ([] for one value a row)");
                int64_t values = 1;
                int overflow = 0;
                json_array_foreach(x, d, dim)
                {
                    if (!int_in(dim, 1, 1 << 30))
                        return io_bad(err, list, i, name,
                                      "every dimension of shape must be an integer >= 1");
                    overflow |= md_mul_i64(values, json_integer_value(dim), &values);
                }
                if (overflow || values > MD_MAX_ROW_VALUES)
                    return io_bad(err, list, i, name, "shape holds more values per row than "
                                                      "the limit of 2^26");
            } else if (strcmp(key, "dtype") == 0) {
                const char *t = json_string_value(x);
                if (!t || (strcmp(t, "float32") && strcmp(t, "float64") && strcmp(t, "int64") &&
                           strcmp(t, "int32") && strcmp(t, "uint8") && strcmp(t, "bool")))
                    return io_bad(err, list, i, name,
                                  "dtype allowed: float32, float64, int64, int32, uint8, bool");
            } else if (inputs && strcmp(key, "preprocess") == 0) {
                const char *k2;
                json_t *v2;
                md_status st;
                if (!json_is_object(x))
                    return io_bad(err, list, i, name,
                                  "preprocess is {\"scale\": s, \"mean\": [..], \"std\": [..]}");
                json_object_foreach(x, k2, v2)
                {
                    if (strcmp(k2, "scale") == 0) {
                        if (!is_num(v2))
                            return io_bad(err, list, i, name, "preprocess.scale is a number");
                    } else if (strcmp(k2, "mean") == 0 || strcmp(k2, "std") == 0) {
                        char k[128];
                        snprintf(k, sizeof k, "%s[%zu].preprocess.%s", list, i, k2);
                        if ((st = check_num_array(v2, k, k2[0] == 's', err)) != MD_OK)
                            return st;
                    } else {
                        return io_bad(err, list, i, name,
                                      "preprocess allows scale, mean and std");
                    }
                }
                json_t *mean = json_object_get(x, "mean"), *std = json_object_get(x, "std");
                if ((mean || std) &&
                    (!mean || !std || json_array_size(mean) != json_array_size(std)))
                    return io_bad(err, list, i, name, "preprocess.mean and std must be given "
                                                      "together, with the same length");
            } else if (!inputs && strcmp(key, "logits") == 0) {
                if (!json_is_boolean(x))
                    return io_bad(err, list, i, name, "logits is true (labels, top_k and "
                                                      "accuracy read this output) or false");
                marked += json_is_true(x);
            } else {
                char what[160];
                snprintf(what, sizeof what, "unknown key \"%s\"; allowed: name, shape, dtype, %s",
                         key, inputs ? "preprocess" : "logits");
                return io_bad(err, list, i, name, what);
            }
        }
        if (inputs && !json_object_get(e, "shape"))
            return io_bad(err, list, i, name, "give its shape per row, e.g. [4] ([] for one "
                                              "value a row)");
        const char *dt = json_string_value(json_object_get(e, "dtype"));
        if (inputs && json_object_get(e, "preprocess") && dt &&
            strcmp(dt, "float32") && strcmp(dt, "float64"))
            return io_bad(err, list, i, name, "preprocess applies to float inputs only");
    }
    if (marked > 1)
        return md_err_setc(err, MD_EUNPROC, "invalid_config",
                           "config.outputs marks %d outputs \"logits\": true; mark the one "
                           "labels, top_k and accuracy read",
                           marked);
    return MD_OK;
}

md_status md_model_config_check(json_t *c, md_err *err)
{
    if (!c || json_is_null(c))
        return MD_OK;
    if (!json_is_object(c))
        return md_err_setc(err, MD_EUNPROC, "invalid_config",
                           "config must be a JSON object such as {\"input\": {\"shape\": [784]}}");
    const char *key;
    json_t *v;
    json_object_foreach(c, key, v)
    {
        if (strcmp(key, "input") == 0) {
            if (!json_is_object(v))
                return bad(err, "input", "give {\"shape\": [d, ...], \"dtype\": \"float32\"}");
            const char *k2;
            json_t *v2;
            json_object_foreach(v, k2, v2)
            {
                if (strcmp(k2, "shape") == 0) {
                    size_t i;
                    json_t *d;
                    /* 7 at most: the batch dimension makes 8, the tensor limit */
                    if (!json_is_array(v2) || json_array_size(v2) == 0 ||
                        json_array_size(v2) > 7)
                        return bad(err, "input.shape",
                                   "give the per-row shape as 1 to 7 positive integers, e.g. "
                                   "[784] or [1, 28, 28]");
                    int64_t values = 1;
                    int overflow = 0;
                    json_array_foreach(v2, i, d)
                    {
                        if (!int_in(d, 1, 1 << 30))
                            return bad(err, "input.shape", "every dimension must be an integer >= 1");
                        overflow |= md_mul_i64(values, json_integer_value(d), &values);
                    }
                    /* the product sizes every row buffer and the test forward */
                    if (overflow || values > MD_MAX_ROW_VALUES) {
                        char prod[32];
                        if (overflow)
                            snprintf(prod, sizeof prod, "more than 2^63");
                        else
                            snprintf(prod, sizeof prod, "%lld", (long long)values);
                        return md_err_setc(err, MD_EUNPROC, "invalid_config",
                                           "config.input.shape holds %s values per row, more "
                                           "than the limit of %lld; give the shape of one row "
                                           "(without the batch dimension), e.g. [784] or "
                                           "[3, 224, 224]",
                                           prod, (long long)MD_MAX_ROW_VALUES);
                    }
                } else if (strcmp(k2, "dtype") == 0) {
                    const char *t = json_string_value(v2);
                    if (!t || (strcmp(t, "float32") && strcmp(t, "float64") && strcmp(t, "int64") &&
                               strcmp(t, "uint8")))
                        return bad(err, "input.dtype", "allowed: float32, float64, int64, uint8");
                } else {
                    char k[96];
                    snprintf(k, sizeof k, "input.%s", k2);
                    return md_err_setc(err, MD_EUNPROC, "invalid_config",
                                       "config has an unknown key \"%s\"; input allows shape, dtype",
                                       k);
                }
            }
        } else if (strcmp(key, "inputs") == 0 || strcmp(key, "outputs") == 0) {
            md_status st = check_io(v, key, err);
            if (st != MD_OK)
                return st;
        } else if (strcmp(key, "preprocess") == 0) {
            if (!json_is_object(v))
                return bad(err, "preprocess", "give {\"scale\": 0.00392, \"mean\": [..], \"std\": [..]}");
            const char *k2;
            json_t *v2;
            md_status st;
            json_object_foreach(v, k2, v2)
            {
                if (strcmp(k2, "scale") == 0) {
                    if (!is_num(v2))
                        return bad(err, "preprocess.scale", "give a number, e.g. 0.00392156862745098 (1/255)");
                } else if (strcmp(k2, "mean") == 0) {
                    if ((st = check_num_array(v2, "preprocess.mean", 0, err)) != MD_OK)
                        return st;
                } else if (strcmp(k2, "std") == 0) {
                    if ((st = check_num_array(v2, "preprocess.std", 1, err)) != MD_OK)
                        return st;
                } else if (strcmp(k2, "image") == 0) {
                    /* checked below, with input.shape */
                } else {
                    return md_err_setc(err, MD_EUNPROC, "invalid_config",
                                       "config has an unknown key \"preprocess.%s\"; preprocess "
                                       "allows scale, mean, std, image",
                                       k2);
                }
            }
            json_t *mean = json_object_get(v, "mean"), *std = json_object_get(v, "std");
            if ((mean || std) && (!mean || !std || json_array_size(mean) != json_array_size(std)))
                return bad(err, "preprocess", "mean and std must be given together, with the same length");
        } else if (strcmp(key, "output") == 0) {
            const char *t = json_string_value(v);
            if (!t || (strcmp(t, "logits") && strcmp(t, "probabilities") && strcmp(t, "raw")))
                return bad(err, "output", "allowed: logits, probabilities, raw");
        } else if (strcmp(key, "threshold") == 0) {
            if (!is_num(v) || !(json_number_value(v) > 0 && json_number_value(v) < 1))
                return bad(err, "threshold", "give the probability above which a class is "
                                             "predicted, a number between 0 and 1 such as 0.5");
        } else if (strcmp(key, "multi_label") == 0) {
            if (!json_is_boolean(v))
                return bad(err, "multi_label", "give true (every output column is a class of "
                                               "its own, an independent sigmoid) or false");
        } else if (strcmp(key, "labels") == 0) {
            size_t i;
            json_t *x;
            if (!json_is_array(v) || json_array_size(v) == 0)
                return bad(err, "labels", "give a non-empty array of class names");
            json_array_foreach(v, i, x)
            {
                if (!json_is_string(x))
                    return bad(err, "labels", "every label must be a string");
            }
        } else if (strcmp(key, "batching") == 0) {
            if (!json_is_object(v))
                return bad(err, "batching", "give an object with max_batch_size, max_delay_us, "
                                            "coalesce_us, queue_limit, timeout_ms");
            const char *k2;
            json_t *v2;
            json_object_foreach(v, k2, v2)
            {
                json_int_t lo = 1, hi = 1000000;
                if (strcmp(k2, "max_delay_us") == 0 || strcmp(k2, "coalesce_us") == 0)
                    lo = 0, hi = 10000000;
                else if (strcmp(k2, "queue_limit") == 0)
                    hi = 10000000;
                else if (strcmp(k2, "timeout_ms") == 0)
                    hi = 3600000;
                else if (strcmp(k2, "max_batch_size") != 0)
                    return md_err_setc(err, MD_EUNPROC, "invalid_config",
                                       "config has an unknown key \"batching.%s\"; batching allows "
                                       "max_batch_size, max_delay_us, coalesce_us, queue_limit, "
                                       "timeout_ms",
                                       k2);
                if (!int_in(v2, lo, hi)) {
                    char k[96], allowed[96];
                    snprintf(k, sizeof k, "batching.%s", k2);
                    snprintf(allowed, sizeof allowed, "give an integer in %lld..%lld",
                             (long long)lo, (long long)hi);
                    return bad(err, k, allowed);
                }
            }
        } else if (strcmp(key, "workers") == 0) {
            if (!int_in(v, 1, 256))
                return bad(err, "workers", "give an integer in 1..256");
        } else if (strcmp(key, "prepack") == 0) {
            if (!json_is_boolean(v))
                return bad(err, "prepack", "give true (the default: each worker packs the "
                                           "model's float32 linear layers once) or false");
        } else if (strcmp(key, "device") == 0) {
            const char *t = json_string_value(v);
            int ok = t && (strcmp(t, "cpu") == 0 || strcmp(t, "cuda") == 0 ||
                           strcmp(t, "auto") == 0);
            if (t && strncmp(t, "cuda:", 5) == 0 && t[5]) {
                ok = 1;
                for (const char *p = t + 5; *p; p++)
                    ok &= *p >= '0' && *p <= '9';
            }
            if (!ok)
                return bad(err, "device", "allowed: cpu, cuda, cuda:N, auto");
        } else {
            return md_err_setc(err, MD_EUNPROC, "invalid_config",
                               "config has an unknown key \"%s\"; allowed: input, inputs, outputs, "
                               "preprocess, output, threshold, multi_label, labels, batching, workers, "
                               "device, prepack",
                               key);
        }
    }
    if (json_object_get(c, "inputs")) {
        static const char *const one_input[] = {"input", "preprocess", NULL};
        for (const char *const *k = one_input; *k; k++)
            if (json_object_get(c, *k))
                return md_err_setc(err, MD_EUNPROC, "invalid_config",
                                   "config.%s describes one input, and config.inputs declares "
                                   "them all: give each input's shape, dtype and preprocess "
                                   "in config.inputs instead",
                                   *k);
    }
    /* threshold and multi_label read a probability: of the outputs
     * themselves or of their sigmoid */
    const char *output = json_string_value(json_object_get(c, "output"));
    int sigmoid_like = output && (!strcmp(output, "probabilities") || !strcmp(output, "logits"));
    if (!sigmoid_like && json_object_get(c, "threshold"))
        return bad(err, "threshold", "a threshold applies to probabilities: declare \"output\": "
                                     "\"probabilities\" (the model ends in a sigmoid) or "
                                     "\"logits\" (modeld applies one) with it");
    if (!sigmoid_like && json_is_true(json_object_get(c, "multi_label")))
        return bad(err, "multi_label", "independent classes are probabilities: declare "
                                       "\"output\": \"probabilities\" (the model ends in "
                                       "sigmoids) or \"logits\" (modeld applies them) with it");
    /* preprocess.image, with the input.shape it must end at */
    md_image_opts io;
    int declared;
    return md_image_opts_from_config(c, MD_IMAGE_MAX_PIXELS_DEFAULT, &io, &declared, err);
}
