/*
 * fuzz_model_config.c - libFuzzer harness for a version's config as a deploy
 * sends it (the multipart `config` field, a query argument, or JSON's
 * "config"): jansson's parser, then md_model_config_check, which bounds
 * input.shape, batching, workers, preprocess and labels before anything is
 * loaded. Checks beyond "no crash": every refusal explains itself on one line.
 * (The multipart framing itself is libmicrohttpd's post processor.)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../predictor/predictor.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    json_error_t jerr;
    json_t *config = json_loadb((const char *)data, size, JSON_DECODE_ANY, &jerr);
    if (!config)
        return 0;
    md_err err;
    md_err_clear(&err);
    if (md_model_config_check(config, &err) != MD_OK &&
        (err.msg[0] == '\0' || strchr(err.msg, '\n')))
        abort();
    json_decref(config);
    return 0;
}
