/*
 * config.h - every setting of modeld, its default, and where it came from.
 *
 * Sources, later wins: defaults < JSON file (--config PATH or MODELD_CONFIG) <
 * environment (MODELD_*) < command-line flags. Naming is mechanical: the key
 * `drain_seconds` is the flag `--drain-seconds` and the variable
 * `MODELD_DRAIN_SECONDS`. A bad value is reported in one line naming the
 * source, the key, the value and what is allowed.
 *
 * md_cfg is a plain struct of values (not opaque): every module reads its
 * settings directly, and after loading it is never mutated, so it is safe to
 * read from any thread.
 */
#ifndef MD_CONFIG_H
#define MD_CONFIG_H

#include <stdio.h>

#include "md_err.h"

/* modeld's version: `modeld --version`, the start-up log line, GET /v2. */
#define MODELD_VERSION "0.1.0"

#ifdef __cplusplus
extern "C" {
#endif

/* A NULL-terminated list of strings (allowed_paths, allowed_urls). */
typedef struct md_strlist {
    char **items; /* owned; items[count] == NULL */
    int count;
} md_strlist;

typedef struct md_cfg {
    /* server */
    char *host;                 /* address to bind */
    int port;                   /* TCP port */
    int threads;                /* HTTP threads; 0 = number of cores */
    long long max_body_bytes;   /* largest request body accepted in memory */
    int connection_timeout_s;   /* a request idle this long is dropped */
    int keepalive_timeout_s;    /* an idle keep-alive connection is closed after this */
    int drain_seconds;          /* on SIGTERM: not ready, then close the listener after this */
    char *access_log;           /* "stderr", "off", or a file path */
    char *log_level;            /* debug | info | warn | error */
    /* store */
    char *store;                /* store directory (index.sqlite, blobs/) */
    char *index_url;            /* "" = store/index.sqlite; postgresql://... = PostgreSQL */
    char *blob_url;             /* "" = store/blobs; s3://BUCKET/PREFIX = S3, store/ a cache */
    long long cache_max_bytes;  /* S3: bound of the store's cache; 0 = none */
    char *s3_path_style;        /* auto | true | false */
    long long max_checkpoint_bytes; /* largest checkpoint upload or download */
    long long max_average_bytes;    /* most stored bytes one weight average reads */
    md_strlist allowed_paths;   /* file:// sources and job inputs must be under one */
    md_strlist allowed_urls;    /* when non-empty, URL sources must match one (scheme, host, port, path) */
    md_strlist allowed_s3;      /* s3:// sources must be under one BUCKET[/PREFIX]; empty = none */
    int allow_private_urls;     /* 1: downloads may reach loopback/private/link-local addresses */
    int download_connect_timeout_s;
    int download_timeout_s;
    int download_max_redirects;
    /* predictor */
    int workers;                /* default workers per loaded version; 0 = cores */
    int intra_op_threads;       /* libtorch intra-op threads per worker */
    int max_batch_size;         /* default rows per forward */
    long long max_image_pixels; /* width x height bound of a decoded image */
    int max_jpeg_scans;         /* scans of a progressive JPEG at most */
    int max_large_decodes;      /* images over 1 Mpx decoded at once (0: cores) */
    long long prepack_max_bytes; /* largest linear weights a worker prepacks; 0 = none */
    long long max_loaded_bytes; /* bytes the loaded versions may hold together; 0 = no bound */
    int max_delay_us;           /* default wait for more rows after a batch's first */
    int coalesce_us;            /* default batching.coalesce_us */
    int queue_limit;            /* default queued requests per version before 503 */
    int timeout_ms;             /* default request deadline before 504 */
    char *default_model;        /* model answering POST /predict; "" = the only one */
    int max_request_images;     /* most images (multipart parts) in one prediction request */
    /* jobs */
    int max_jobs;               /* jobs running at once */
    int job_nice;               /* nice of the job workers (0..19) */
    int job_lease_s;            /* a silent job runner's jobs are taken over after this */
    int job_retention_s;        /* remove ended jobs this long after they ended; 0 = never */
    int job_max_files;          /* images inputs: most files and folders listed */
    long long job_max_image_bytes; /* images inputs: largest image file read */
    int store_poll_ms;          /* converge on other replicas' changes this often; 0 = never */
    int test_job_chunk_delay_ms; /* for tests only: pause after each committed job chunk */
    /* auth: bearer tokens, each list the setting's own plus its *_file's
     * lines (md_cfg_load reads the files). Secrets: never printed. */
    md_strlist admin_token;     /* routes that change state; empty: open */
    md_strlist predict_token;   /* predictions and reads; empty: open */
    md_strlist metrics_token;   /* GET /metrics; empty: open */
    char *admin_token_file;
    char *predict_token_file;
    char *metrics_token_file;
    int open_admin;             /* 1: admin routes open on purpose while other tokens are set */
} md_cfg;

/* What main should do after loading. */
typedef enum md_cfg_action {
    MD_CFG_RUN = 0,       /* start the server */
    MD_CFG_HELP,          /* print md_cfg_print_help and exit 0 */
    MD_CFG_PRINT_CONFIG,  /* print md_cfg_to_json and exit 0 */
    MD_CFG_VERSION,       /* print the version and exit 0 */
} md_cfg_action;

/* Fill `cfg` with the defaults. `cfg` must later be freed with md_cfg_free. */
void md_cfg_defaults(md_cfg *cfg);

/*
 * Load every source into `cfg` (which this function initialises with the
 * defaults first): the JSON file named by --config or MODELD_CONFIG, then
 * `envp` (NULL-terminated "KEY=VALUE" strings; NULL for none), then argv[1..].
 * On failure returns MD_EINVAL with a one-line message in `err` naming the
 * source, key, value and what is allowed; `cfg` still needs md_cfg_free.
 * `action` receives what the flags ask for (--help, --print-config, --version).
 * Not thread-safe (call once at start).
 */
md_status md_cfg_load(md_cfg *cfg, int argc, char **argv, char **envp, md_cfg_action *action,
                      md_err *err);

/* Free what `cfg` owns. Accepts NULL; leaves `cfg` zeroed. */
void md_cfg_free(md_cfg *cfg);

/* The effective configuration as a JSON object text. Returns a new malloc'd
 * string the caller frees. */
char *md_cfg_to_json(const md_cfg *cfg);

/* Print usage: every setting with its flag, env name, default and meaning. */
void md_cfg_print_help(FILE *out);

/* The number of online CPU cores (at least 1). */
int md_cfg_cores(void);

#ifdef __cplusplus
}
#endif
#endif
