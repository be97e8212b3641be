/*
 * fuzz_config.c - libFuzzer harness for the configuration loader: the JSON
 * config file (--config), MODELD_* variables and flags, all from one input.
 * The input is split at NUL bytes: the first part is the config file's
 * bytes, the rest are command-line arguments; a part starting "MODELD_"
 * is an environment entry instead. Checks beyond "no crash": a failure
 * explains itself on one line, and a success gives a configuration that
 * prints as JSON.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../config/config.h"

#define MAX_PARTS 16

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int fd = -1;
    if (fd < 0 && (fd = memfd_create("modeld-config", 0)) < 0)
        abort();
    char *buf = malloc(size + 1);
    memcpy(buf, data, size);
    buf[size] = '\0';
    /* the config file: the bytes up to the first NUL */
    size_t file_len = strnlen(buf, size);
    if (ftruncate(fd, 0) != 0 || pwrite(fd, buf, file_len, 0) != (ssize_t)file_len)
        abort();
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    char *argv[MAX_PARTS + 4] = {"modeld", "--config", path};
    char *envp[MAX_PARTS + 1];
    int argc = 3, envc = 0;
    for (size_t i = file_len + 1; i < size && argc < MAX_PARTS + 3 && envc < MAX_PARTS;) {
        char *part = buf + i;
        size_t n = strnlen(part, size - i);
        if (strncmp(part, "MODELD_", 7) == 0)
            envp[envc++] = part;
        else if (strcmp(part, "--help") && strcmp(part, "--version"))
            argv[argc++] = part;
        i += n + 1;
    }
    argv[argc] = NULL;
    envp[envc] = NULL;
    md_cfg cfg;
    md_cfg_action act;
    md_err err;
    md_err_clear(&err);
    if (md_cfg_load(&cfg, argc, argv, envp, &act, &err) == MD_OK) {
        char *json = md_cfg_to_json(&cfg);
        if (!json)
            abort();
        free(json);
    } else if (err.msg[0] == '\0' || strchr(err.msg, '\n')) {
        abort(); /* every failure explains itself, on one line */
    }
    md_cfg_free(&cfg);
    free(buf);
    return 0;
}
