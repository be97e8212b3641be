/*
 * predictor.h - the predictor: tensors and their codecs (JSON, NPY, V2),
 * model version configs, loaded model versions with their batching workers
 * (batcher.c, over the libtorch backend), and the registry of loaded
 * versions. Batch jobs, which use all of this, are jobs/jobs.h's; nothing
 * here includes it.
 *
 * Per-version config, given at deploy:
 *   input {shape: [d...], dtype: float32|float64|int64|uint8}
 *   preprocess {scale, mean: [], std: []}   (torchvision ToTensor + Normalize)
 *     preprocess.image {mode: L|RGB, resize, center_crop}   (image.h)
 *   output: logits | probabilities | raw
 *   threshold: 0 < t < 1, multi_label: bool   (how outputs read as classes: classes.c)
 *   labels: ["class", ...]
 *   batching {max_batch_size, max_delay_us, queue_limit, timeout_ms}
 *   workers, device: cpu | cuda | cuda:N | auto
 *
 * Thread safety: the config check, codecs and tensor helpers are pure
 * functions of their arguments (an md_tensor itself is used by one thread at
 * a time); md_model_* and md_registry_* say per function what may be called
 * concurrently.
 */
#ifndef MD_PREDICTOR_H
#define MD_PREDICTOR_H

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#include "../checkpoint/checkpoint.h"
#include "../config/md_err.h"
#include "../config/md_metrics.h"
#include "image.h"
#include "torch_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MD_MAX_DIMS 8

/* The most values one input row may hold (the product of config.input.shape,
 * a dataset row's width): 2^26 floats, 256 MiB a row, far past any image or
 * sequence a model server takes (3x224x224 is 150,528), and small enough that
 * rows x values never overflows where rows is bounded by a body or a batch. */
#define MD_MAX_ROW_VALUES ((int64_t)1 << 26)

/* The largest top_k a prediction or a job may ask (400 past it). Selection
 * costs O(classes log k), so this bounds the answer's size, not the CPU. */
#define MD_TOP_K_MAX 1000

typedef struct md_tensor md_tensor;
typedef struct md_arrays md_arrays; /* named arrays of a request (below) */

/* Check a version config object; MD_EUNPROC naming the key and what is
 * allowed when a key is unknown or a value is wrong. NULL is a valid {}. */
md_status md_model_config_check(json_t *config, md_err *err);

/* ---- loaded model versions (model.c) and their batchers (batcher.c) ---- */

typedef struct md_model md_model;

/* Defaults for settings a version's config does not give. */
typedef struct md_model_defaults {
    int workers;
    int max_batch_size;
    int max_delay_us;
    int queue_limit;
    int timeout_ms;
    int job_nice;       /* nice of the job workers, 0..19 */
    long long max_image_pixels; /* bound on an image's width x height (0: the default) */
    long long prepack_max_bytes; /* all packed copies of a version's linear weights (0: never) */
    int max_jpeg_scans;         /* bound on a progressive JPEG's scans (0: the default) */
    int coalesce_us;            /* batching.coalesce_us (0: a free worker takes every request) */
} md_model_defaults;

/*
 * Load version `version` of model `name` from the TorchScript file `path`
 * with its `config` (borrowed), run one test forward on the declared input
 * shape. Returns a model holding one reference; its batching workers start
 * with md_model_start (the registry's put, or its first request). MD_EUNPROC with libtorch's message when it does not load or the
 * test forward fails.
 */
md_status md_model_load(const char *name, int version, const char *path, json_t *config,
                        const md_model_defaults *defaults, md_model **out, md_err *err);

/* As md_model_load, for a state_dict version: `path` is the model's
 * architecture (TorchScript) and `weights_path` a torch.save state_dict or a
 * safetensors file (`weights_format` "torch_save" or "safetensors", as
 * md_weights_format tells), loaded into it strictly (md_weights_load). With
 * weights_path NULL it is md_model_load. */
md_status md_model_load_weights(const char *name, int version, const char *path,
                                const char *weights_path, const char *weights_format,
                                json_t *config, const md_model_defaults *defaults, md_model **out,
                                md_err *err);

/* Start the version's batching workers (and the packed copies they make),
 * once; later calls return at once. md_registry_put and every submit call
 * it, so a version that is only loaded to be validated costs no threads.
 * MD_EBUSY when the threads cannot be created. Thread-safe. */
md_status md_model_start(md_model *m, md_err *err);

/* Reference counting; the last release stops the workers (after the queue is
 * empty) and frees the model. Thread-safe; release accepts NULL. */
void md_model_retain(md_model *m);
void md_model_release(md_model *m);

/* Wait until every worker thread of every model has exited (after the last
 * releases), at most timeout_s; returns how many are still alive. main()
 * calls it before returning: exit() must not run libtorch's destructors
 * under a worker still inside libtorch. Thread-safe. */
int md_models_wait_stopped(double timeout_s);

/* The accessors below read fields fixed at load (name, version, max_batch,
 * labels, logits), the input shape (published once, with release/acquire)
 * or atomic counters: thread-safe for any caller holding a reference. */

/* The model's name; borrowed, valid while a reference is held. */
const char *md_model_name(const md_model *m);
/* Set the version number once it is known. Not thread-safe: only before the
 * model is shared (put in the registry or handed to another thread). */
void md_model_set_version(md_model *m, int version);
int md_model_version(const md_model *m);
/* batching.max_batch_size of this version (its config, else the server's). */
int md_model_max_batch(const md_model *m);
/* The declared labels (borrowed JSON array, never mutated; valid while a
 * reference is held) or NULL. */
json_t *md_model_labels(const md_model *m);
/* The version's declared image preprocessing (config preprocess.image, read
 * at load with the server's max_image_pixels), or NULL when it declares none
 * and takes numbers only. Borrowed, valid while a reference is held. */
const md_image_opts *md_model_image(const md_model *m);
/* 1 when the output is declared logits (softmax before scores). */
int md_model_output_logits(const md_model *m);
/* The bytes this version keeps resident: its module's parameters and
 * buffers (md_torch_resident_bytes, measured at load) and its packed copies
 * (prepack), counted as they are made. The one figure the
 * registry's max_loaded_bytes budget counts, so whatever else a version comes
 * to hold for good belongs in it. */
long long md_model_resident_bytes(const md_model *m);
/* Count one online answer of this version: `ok` a prediction answered after
 * `seconds` (from the request's first byte), else an error the version or
 * the server caused (a failed forward, a timeout, a full queue; not a
 * client's bad request). Lock-free. */
void md_model_note_answer(md_model *m, int ok, double seconds);
/* The live numbers since this version was loaded on this server:
 * {"requests", "errors", "error_rate", "p50_ms", "p99_ms"} (the latencies
 * estimated from a histogram, null before the first answer). New reference. */
json_t *md_model_live(const md_model *m);
/* Its module's parameters and buffers alone: what it holds whatever the
 * load (the budget refuses a version whose weights alone exceed it; packed
 * copies are optional). */
long long md_model_weight_bytes(const md_model *m);
/* References held now (a snapshot). The registry reads it under its lock,
 * where 1 means only its own: no request or job is using the version. */
int md_model_refs(const md_model *m);

/* ---- how an output row reads as classes (classes.c) ----
 *
 * One rule for online labels, scores and top_k and for a job's predictions,
 * accuracy and confusion matrix, so they never disagree:
 * - several columns: one class per row, the largest (ARGMAX); scores are the
 *   softmax when config.output is "logits", else the values as they are;
 * - multi_label: every column is a class of its own, present when its
 *   probability passes the threshold (MULTI): sigmoid of logits, or the
 *   probabilities as they are;
 * - one column declared "probabilities" or "logits": a binary classifier
 *   (BINARY), class 1 when the probability passes the threshold (0.5 unless
 *   config.threshold says otherwise; for logits the same test on the logit,
 *   so 0 by default), class 0 otherwise, as PyTorch's (p > 0.5) == y;
 * - one column of undeclared meaning ("raw" or no output): no classes
 *   (NONE): a job counts no accuracy and says why, top_k is refused.
 */
typedef enum md_classes_kind {
    MD_CLASSES_ARGMAX = 0, /* the largest of several columns */
    MD_CLASSES_BINARY,     /* one column against a threshold: classes 0 and 1 */
    MD_CLASSES_MULTI,      /* multi_label: each column against the threshold */
    MD_CLASSES_NONE,       /* one column of undeclared meaning: no classes */
} md_classes_kind;

typedef struct md_classes {
    md_classes_kind kind;
    int64_t width;     /* values per output row */
    int64_t classes;   /* ARGMAX, MULTI: width; BINARY: 2; NONE: 0 */
    int logits;        /* the values are logits (softmax or sigmoid for scores) */
    double threshold;  /* BINARY, MULTI: a probability in (0, 1) */
    double cut;        /* the threshold on the values themselves (its logit for logits) */
} md_classes;

/* The rule for output rows `width` values wide from a version's config
 * (output, threshold, multi_label); pure, thread-safe. */
md_classes md_classes_from_config(json_t *config, int64_t width);
/* The same from a loaded version (thread-safe for a holder of a reference). */
md_classes md_model_classes(const md_model *m, int64_t width);
/* Why a NONE rule has no classes, with the fix: a sentence for a job's
 * accuracy_note or an error. */
const char *md_classes_none_reason(void);
/* The probability of each class of one row into p[0..c->classes): ARGMAX
 * softmax (logits) or the values, BINARY {1 - p, p}, MULTI each column's
 * sigmoid (logits) or its value. Not for NONE. */
void md_classes_probs(const md_classes *c, const float *y, float *p);
/* The class of one row: ARGMAX the largest (NaN last, ties to the lower
 * index, as md_top_k), BINARY 1 when past the threshold; -1 for MULTI and
 * NONE, which have no single class. */
int64_t md_classes_top(const md_classes *c, const float *y);
/* MULTI: 1 when column j of row y is present. */
int md_classes_present(const md_classes *c, const float *y, int64_t j);
/* The k most likely classes of one row, best first, into idx (k <= classes),
 * with their probabilities into score: for BINARY the decided class first,
 * whatever the threshold. Returns k. `p` is scratch of c->classes floats. */
int64_t md_classes_top_k(const md_classes *c, const float *y, int64_t k, float *p, int64_t *idx,
                         float *score);
/* The declared per-row input shape into `shape` (room for MD_MAX_DIMS);
 * returns its dims, 0 when not declared (nor learned from a first request). */
int md_model_input_shape(const md_model *m, int64_t *shape);
/* ---- declared inputs and outputs (config.inputs, config.outputs) ----
 * Fixed at load; thread-safe for any holder of a reference. */

/* One declared input or output. Pointers borrowed while the reference is held. */
typedef struct md_io_info {
    const char *name;
    const char *dtype;     /* inputs: declared; outputs: what the model returns (answered
                            * as float32) */
    int is_int;            /* inputs: read as integers */
    int ndim;              /* per row */
    const int64_t *shape;
    int64_t values;        /* per row */
    int64_t off;           /* outputs: where its values start in a row of the answer */
} md_io_info;

/* Declared inputs; 0: one unnamed input (config.input), the request forms
 * md_tensor_decode reads. */
int md_model_n_inputs(const md_model *m);
/* Declared outputs; 0: the answer is the first tensor forward returns. With
 * outputs, a prediction's answer (md_predict_cb's `out`) is [rows,
 * md_model_output_values] with output j's row at md_io_info.off. */
int md_model_n_outputs(const md_model *m);
int64_t md_model_output_values(const md_model *m);
void md_model_input(const md_model *m, int i, md_io_info *out);
void md_model_output(const md_model *m, int j, md_io_info *out);
/* The output labels, top_k and accuracy read (md_model_n_outputs > 0): the
 * one marked "logits": true, or the only one; -1 when none. */
int md_model_classes_output(const md_model *m);
/*
 * Decode a JSON body for a version with named inputs `in[0..n)`
 * (md_model_input): rows as objects keyed by input name ([{...}, ...] or
 * {"instances": [...]}), TF Serving's columns ({"inputs": {name: rows}},
 * *columnar set), and for one input its rows as a plain array. Integers for
 * integer inputs are read exactly; each value must have the input's declared
 * shape. One array per input into `out` (dim 0 the rows). At most
 * max_values values (MD_ETOOBIG). Errors (MD_EINVAL, invalid_input) name the
 * row and the input. Thread-safe (rows.c).
 */
md_status md_named_decode(const char *body, size_t len, const md_io_info *in, int n,
                          size_t max_values, md_arrays *out, int *columnar, md_err *err);
/* Pack named arrays (a request's or a job chunk's) into the version's rows:
 * each declared input once by name, `rows` rows in each (dim 0), the rest
 * its declared shape; integers for integer inputs (a float there is refused,
 * never rounded), floats or integers for float inputs (each input's
 * preprocess applies at submit, by the version the rows go to). `out` gets
 * [rows, words] with packed set, for md_model_submit. MD_EINVAL (400, code invalid_input) naming the input:
 * missing, unknown, of another shape, dtype or row count. `a` stays the
 * caller's. Thread-safe. */
md_status md_model_pack(const md_model *m, const md_arrays *a, md_tensor *out, md_err *err);

/* As md_model_pack for `rows` rows already laid out as it packs them (a
 * job's reader fills them: md_reader_opts.inputs): `words` (ownership taken,
 * even on failure) becomes out->data, its integers checked against their
 * dtypes. */
md_status md_model_pack_rows(const md_model *m, float *words, int64_t rows, md_tensor *out,
                             md_err *err);
/* Counters as JSON: batches, rows, requests, queue wait, batch size histogram. New reference. */
json_t *md_model_stats(const md_model *m);

/* Called on a worker thread when a submitted request is done. `out` (shape
 * `out_shape[0..ndim)`, C order float32) is valid only during the call. */
typedef void (*md_predict_cb)(void *ctx, md_status st, const md_err *err, const float *out,
                              const int64_t *out_shape, int ndim);

typedef enum md_priority { MD_PRIO_ONLINE = 0, MD_PRIO_BATCH = 1 } md_priority;

/*
 * Queue `in` (ownership taken, even on failure) for prediction. The input
 * is shaped to the model's declared per-row shape (a single row is a batch
 * of one), cast and preprocessed. On MD_OK `cb` will be called exactly once
 * from a worker thread; on failure (bad shape MD_EINVAL, queue full MD_EBUSY)
 * it is not called. Online requests larger than max_batch_size are split
 * and reassembled; a MD_PRIO_BATCH request (a job chunk) is one forward of
 * all its rows, on the version's job workers. Thread-safe.
 */
md_status md_model_submit(md_model *m, md_tensor *in, md_priority prio, md_predict_cb cb,
                          void *ctx, md_err *err);

/* Whether the requester still wants the answer; called on a worker thread
 * just before a queued request is computed. */
typedef int (*md_alive_fn)(void *ctx);

/* As md_model_submit; a request whose `alive(ctx)` returns 0 when a worker
 * takes it is not computed: `cb` gets MD_EUNAVAIL with code "client_closed". */
md_status md_model_submit_alive(md_model *m, md_tensor *in, md_priority prio, md_predict_cb cb,
                                md_alive_fn alive, void *ctx, md_err *err);

/* ---- training checkpoints: weights apart from the architecture (weights.c) ---- */

/*
 * A version is either a TorchScript archive (structure and weights in one
 * file) or weights alone (a torch.save state_dict or a safetensors file)
 * loaded into its model's architecture, a TorchScript archive whose own
 * weights do not matter. The format is told by content, never by name.
 */
#define MD_FORMAT_TORCHSCRIPT "torchscript"
#define MD_FORMAT_TORCH_SAVE "torch_save"
#define MD_FORMAT_SAFETENSORS "safetensors"

/* The format of the file at `path`: one of the MD_FORMAT_* strings (static).
 * MD_EUNPROC (code invalid_checkpoint) for the legacy pre-1.6 torch.save
 * format (saying how to re-save it) and for anything else. Thread-safe. */
md_status md_weights_format(const char *path, const char **format, md_err *err);

/* The named tensors of a torch.save or safetensors file (`format` from
 * md_weights_format), read without running code from the file. `arch_numel`
 * is the element count of the architecture they are for
 * (md_weights_arch_numel), or -1 for none: a torch.save file's tensors may
 * copy out to at most 8 bytes per element of it plus MD_WEIGHTS_ARCH_SLACK
 * (64 MiB, so a smaller model's file still gets its mismatch listed), else
 * MD_ETOOBIG (code checkpoint_too_large) before anything is copied; with
 * none, to MD_CKPT_MAX_TOTAL_BYTES. New list the caller frees. Thread-safe. */
md_status md_weights_read(const char *path, const char *format, int64_t arch_numel,
                          md_tensors **out, md_err *err);

/* The elements of the parameters and buffers of the TorchScript
 * architecture at `arch_path` together (it is loaded on the CPU to count
 * them). Thread-safe. */
md_status md_weights_arch_numel(const char *arch_path, int64_t *numel, md_err *err);

/* Load the architecture at `arch_path` and set its parameters and buffers
 * from the file `weights_path` strictly (md_torch_load_state): 422-worthy
 * MD_EUNPROC listing missing, unexpected and mismatched keys. Thread-safe. */
md_status md_weights_load(const char *arch_path, const char *weights_path, const char *format,
                          const char *device, md_dtype input_dtype, md_torch_model **out,
                          md_err *err);

/* The architecture's parameter table: {"parameters": [{"name", "shape",
 * "dtype", "kind": "parameter"|"buffer"}], "count", "numel"}. MD_EUNPROC
 * when it is not a loadable TorchScript archive. `arch_sha256` (may be NULL)
 * names the archive's content: tables are read once per process and kept
 * by it (the last 32), as in the functions below. New reference.
 * Thread-safe. */
md_status md_weights_table(const char *arch_path, const char *arch_sha256, json_t **out,
                           md_err *err);

/*
 * A version's weights as its model uses them: the architecture's names, in
 * its order, with its dtypes. `path` is the version's file of `format`; for a
 * torch.save or safetensors file `arch_path` is the architecture it loads
 * into ("module." stripped when that makes the keys match, float16/bfloat16/
 * float64 converted), for a TorchScript archive its own parameters and
 * buffers (arch_path unused). New list the caller frees. Thread-safe.
 */
md_status md_weights_effective(const char *path, const char *format, const char *arch_path,
                               const char *arch_sha256, md_tensors **out, md_err *err);

/*
 * The same weights written to `fd` as a safetensors file with the metadata
 * of `meta` (may be NULL), piece by piece: the header from the
 * architecture's table (read without its data), then each tensor at its
 * offset as the version's file yields it (pwrite from offset 0; *size is the
 * file's length). Memory holds about one tensor of the file and its
 * converted copy, never the model, except for a TorchScript version, whose
 * module is loaded whole (the weights are its own). The errors of
 * md_weights_effective, plus MD_EIO when `fd` cannot be written. Thread-safe.
 */
md_status md_weights_export(const char *path, const char *format, const char *arch_path,
                            const char *arch_sha256, const md_tensors *meta, int fd,
                            uint64_t *size, md_err *err);

/*
 * A weighted mean built one source at a time, so that averaging n versions
 * holds one source's weights plus the sums (a double per floating element),
 * never all n: md_weights_avg_add each source with its weight `w` (used as
 * given; the caller normalises), then md_weights_avg_finish. The first source
 * sets the names, shapes and dtypes; a later one that differs is MD_EINVAL
 * naming the first difference (`label` names the source in messages, "version
 * 3") and leaves the sums as they were. Floating tensors are sum(w[i] *
 * src[i]) computed in double, integer and bool tensors the last source's.
 * MD_ENOMEM / MD_ETOOBIG when the sums cannot be held. The sources stay the
 * caller's (free each after its add). One request's object: not thread-safe.
 */
typedef struct md_weights_avg md_weights_avg;
/* A new, empty average. Never fails (small allocation). */
md_weights_avg *md_weights_avg_new(void);
/* Accepts NULL. */
void md_weights_avg_free(md_weights_avg *a);
md_status md_weights_avg_add(md_weights_avg *a, const md_tensors *src, double w,
                             const char *label, md_err *err);
/* The mean as a new list the caller frees (MD_EINVAL when nothing was added). */
md_status md_weights_avg_finish(md_weights_avg *a, md_tensors **out, md_err *err);

/* ---- the registry of loaded versions (registry.c) ---- */

typedef struct md_registry md_registry;

/* Thread safety: every md_registry_* function but new and free is safe to
 * call from any thread, the HTTP threads included: one mutex per registry,
 * held only for the lookup or the swap, never across a load or a forward.
 * `name` arguments are borrowed for the call. */

/* Why a version left the registry (modeld_model_unloads_total's reason). */
typedef enum md_unload_reason {
    MD_UNLOAD_BUDGET = 0, /* room made under max_loaded_bytes */
    MD_UNLOAD_OPERATOR,   /* POST /models/NAME/versions/V/unload */
    MD_UNLOAD_DELETED,    /* the version or its model was deleted (here or by a replica) */
    MD_UNLOAD_REPLACED,   /* another version became the default, or a reload replaced it */
    MD_UNLOAD_REASONS
} md_unload_reason;

/* What the registry knows of one loaded version (md_registry_info). */
typedef struct md_registry_entry {
    int loaded;               /* 0: nothing below is set */
    int is_default;
    int version;
    long long resident_bytes; /* md_model_resident_bytes */
    double last_used;         /* Unix time of its last lookup (or its load) */
    json_t *live;             /* md_model_live: a new reference the caller owns */
} md_registry_entry;

/* A new, empty registry with no budget (aborts on OOM: made once at start). */
md_registry *md_registry_new(void);
/* Bound the resident bytes of the loaded versions together (max_loaded_bytes;
 * 0: no bound). Not thread-safe: once, before the registry is shared. */
void md_registry_set_budget(md_registry *r, long long max_bytes);
long long md_registry_budget(const md_registry *r);
/* Releases every model. Accepts NULL. Not thread-safe: call once no other
 * thread uses the registry. */
void md_registry_free(md_registry *r);
/* The loaded model for name and version (0 = the default), retained (the
 * caller releases it), and marked used now (the budget unloads the least
 * recently used first); or NULL. Never loads or blocks on I/O. */
md_model *md_registry_get(md_registry *r, const char *name, int version);
/* What is loaded for name and version (0 = the default) into *out, without
 * counting as a use; returns out->loaded. */
int md_registry_info(md_registry *r, const char *name, int version, md_registry_entry *out);
/* The version that is `name`'s default here, loaded or unloaded to free
 * memory (it stays the default: the next request loads it); 0 when none. */
int md_registry_default_version(md_registry *r, const char *name);
/* Add `m` (takes the caller's reference); when `make_default` it becomes the
 * default of its name atomically, and the old default is released once its
 * queue drains. Replaces an entry for the same name and version (releasing
 * the registry's reference to the one replaced). Ignores the budget: loads
 * go through md_registry_reserve and md_registry_admit. */
void md_registry_put(md_registry *r, md_model *m, int make_default);
/* Before loading version `version` of `name`, expected to hold about
 * `bytes`: unload the least recently used versions nobody is using (defaults
 * last) until the loaded bytes, the bytes promised to other loads under way
 * and these fit the budget, and promise them to this load (*reserved, to
 * give back with md_registry_unreserve once the load is over, whatever its
 * outcome). MD_EBUSY naming max_loaded_bytes when the versions in use leave
 * no room. With no budget: MD_OK, *reserved 0. */
md_status md_registry_reserve(md_registry *r, const char *name, int version, long long bytes,
                              long long *reserved, md_err *err);
void md_registry_unreserve(md_registry *r, long long reserved);
/* md_registry_put under the budget: `m` goes in with its real resident
 * bytes, then the least recently used versions nobody is using (defaults
 * last) are unloaded until everything fits. Takes the caller's reference
 * even on failure: MD_ETOOBIG when `m` alone is larger than the budget,
 * MD_EBUSY (naming max_loaded_bytes) when the versions in use leave no room;
 * `m` is not in the registry then. `reserved` (md_registry_reserve's promise
 * for this load, 0 for none) is given back in the same step that counts m's
 * real size, whatever the outcome, so two loads never count on the same
 * free bytes. */
md_status md_registry_admit(md_registry *r, md_model *m, int make_default, long long reserved,
                            md_err *err);
/* Make a loaded version the default; 0 when it is not loaded. */
int md_registry_set_default(md_registry *r, const char *name, int version);
/* Drop one version (version 0: every version of `name`), releasing the
 * registry's references; requests already holding one finish. For deletes
 * (counted as such): a deleted default is no longer the default here. */
void md_registry_remove(md_registry *r, const char *name, int version);
/* Unload one version for the operator, in flight or not (requests holding
 * it finish, then it is freed). A default stays the default and is loaded
 * again by its next request. Returns 1 when it was loaded. */
int md_registry_unload(md_registry *r, const char *name, int version);
/* Count one load of a version into memory that took `seconds`. */
void md_registry_note_load(md_registry *r, double seconds);
/* Names of the models with a default (loaded, or unloaded to free memory),
 * as a JSON array. New reference. */
json_t *md_registry_names(md_registry *r);
/* Stats of every loaded version, as a JSON array. New reference. */
json_t *md_registry_stats(md_registry *r);
/* Write every loaded version's metrics (Prometheus text) to `f`. Retains
 * the models under the registry lock and formats without it. Thread-safe. */
void md_registry_write_metrics(md_registry *r, FILE *f);
/* The metric families of `n` models (is_default[i]: the name's default),
 * read from atomics only: never takes a batcher lock. */
void md_models_write_metrics(md_model *const *ms, const int *is_default, int n, FILE *f);

/* ---- tensors and codecs (tensor.c: JSON and shared helpers; npy.c; v2.c) ---- */

/* A dense float32 tensor in C order. `data` is owned (malloc).
 * Not opaque, on purpose: decoders fill a caller-owned md_tensor (on the
 * handler's stack, no allocation for the header), and the batcher, the
 * encoders and the jobs read shape/data/count on every request and row;
 * accessors and a heap header would cost an allocation per request on the
 * hot path for no protection. Used by one thread at a time. */
struct md_tensor {
    int ndim;
    int64_t shape[MD_MAX_DIMS];
    float *data;
    size_t count; /* product of shape */
    /* 1: the values are ToTensor's already (decoded images, v / 255), so the
     * version's preprocess.scale is not applied; mean/std still are */
    int prescaled;
    /* not 0: md_model_pack made it (a row is the inputs' words side by
     * side), for versions with these very inputs (a hash of their names,
     * dtypes and shapes): such a version takes no other tensor, and a
     * version without declared inputs takes none of these */
    int packed;
};

/* Free the data of `t` and zero it. Accepts NULL. */
void md_tensor_free(md_tensor *t);

/* ---- several named inputs (issue 27): arrays by name ---- */

/* The longest input or output name, with its NUL (MD_MAX_IO: torch_backend.h). */
#define MD_IO_NAME_MAX 64

/* One named array of a request body, as its format gave it: integers (and
 * booleans) as int64, read as integers and never through float, floating
 * values as float32. Exactly one of f32 and i64 is set (owned, malloc)
 * unless count is 0. Used by one thread at a time. */
typedef struct md_array {
    char name[MD_IO_NAME_MAX];
    int ndim;
    int64_t shape[MD_MAX_DIMS];
    size_t count;  /* product of shape */
    int is_int;    /* 1: the values are in i64, 0: in f32 */
    char datatype[8]; /* V2's datatype ("FP32", "INT64", ...) when the request said one
                       * (it must then be the input's declared dtype), else "" */
    float *f32;
    int64_t *i64;
} md_array;

/* The named arrays of one request: n of them, names unique. */
struct md_arrays {
    int n;
    md_array a[MD_MAX_IO];
};

/* Free every array's data and zero `a`. Accepts NULL. */
void md_arrays_free(md_arrays *a);
/* The array named `name`, or NULL. */
md_array *md_arrays_find(md_arrays *a, const char *name);

/*
 * Decode an NPZ body (numpy.savez / savez_compressed: a zip of NAME.npy
 * members, stored or deflated) into named arrays, one per member, the name
 * without ".npy". Each member is an NPY file as md_npy_decode reads it (C
 * order; float16/32/64 into f32, bool/uint8/int8/int16/int32/int64/uint16/
 * uint32 into i64; uint64 past int64's range, object arrays and Fortran order
 * refused). At most MD_MAX_IO members and `max_values` values together
 * (MD_ETOOBIG past either, before the member is inflated); every size in
 * the zip is checked against `len` and the bound before anything is
 * allocated, so a request never costs more than a small multiple of its
 * size. Errors (MD_EINVAL) name the member and the problem. Thread-safe.
 */
md_status md_npz_decode(const char *data, size_t len, size_t max_values, md_arrays *out,
                        md_err *err);

/* Whether md_tensor_decode reads a body of this Content-Type (NULL: none
 * given) as JSON rows: application/json, x-www-form-urlencoded (curl -d),
 * text/plain. Any thread. */
int md_tensor_json_type(const char *content_type);

/*
 * Decode a prediction request body into a tensor: a JSON array of rows,
 * {"instances": rows} (TF Serving), {"array": data, "shape"?: [...]} (Ray
 * Serve), or an NPY file when `content_type` is application/x-npy. Numbers
 * are decoded without building a JSON tree. Errors (MD_EINVAL) name the row
 * and column: ragged rows, strings, NaN, non-numbers. At most `max_values`
 * numbers (MD_ETOOBIG past it). Thread-safe.
 */
md_status md_tensor_decode(const char *body, size_t len, const char *content_type,
                           size_t max_values, md_tensor *out, md_err *err);

/*
 * Decode one Open Inference Protocol V2 input object ({"name", "shape",
 * "datatype", "data"}; data flat or nested, numbers or booleans) into a
 * float32 tensor of its shape. The shape's product is overflow-checked and
 * bounded by `max_values` before anything is allocated (MD_ETOOBIG); a value
 * outside float32's range, a wrong count or a non-number is MD_EINVAL naming
 * it. `in` is borrowed. Thread-safe.
 */
md_status md_v2_decode(json_t *in, size_t max_values, md_tensor *out, md_err *err);

/* Values and keys a V2 request's JSON may hold outside inputs[0].data, in
 * what modeld reads (inputs, id, outputs, parameters): ids, names, shape,
 * binary_data flags. Past it the request is 413 too_many_json_values. */
#define MD_V2_MAX_JSON_VALUES 4096

/*
 * Parse a V2 inference request's JSON (`len` bytes): its root, a new
 * reference, or NULL with `err` set (400: not JSON; 413: too many values).
 * Only the members modeld reads are built: every other value is validated
 * in place and null in the root (tensor.c's DESIGN). When `read_data` and
 * the first input's "data" is one array the row scanner reads (numbers,
 * rectangular when nested, as many as the shape holds), it is read that
 * way, ~15x faster than jansson, into `t` in the input's shape, and
 * *decoded is 1: the root then holds "data": [] in its place. Otherwise
 * *decoded is 0 and the root holds the data (at most max_values values),
 * for md_v2_decode to read and report on. Thread-safe.
 */
json_t *md_v2_parse(const char *body, size_t len, size_t max_values, int read_data, md_tensor *t,
                    int *decoded, md_err *err);

/* The same for an input sent with the binary tensor data extension: `bytes`
 * (`nbytes`, the input's binary_data_size) hold its values little-endian in
 * C order, of any numeric datatype (FP16 and BF16 too); they are converted to
 * float32. The size must be exactly the shape's; NaN, infinities and values
 * past float32's range are refused. Thread-safe. */
md_status md_v2_decode_binary(json_t *in, const void *bytes, size_t nbytes, size_t max_values,
                              md_tensor *out, md_err *err);

/* md_v2_parse for a request of several (or integer) inputs: every input's
 * "data" is left out of the root (it holds [] there) and where it lies in
 * the body is recorded instead, span_a[i]..span_b[i] for inputs[i] (both 0:
 * no data; room for MD_MAX_IO), for md_v2_text_array. Their values together
 * are at most max_values (413). So the request costs its body and a small
 * tree, not a jansson node per value. Thread-safe. */
json_t *md_v2_parse_spans(const char *body, size_t len, size_t max_values, size_t *span_a,
                          size_t *span_b, md_err *err);
/* One V2 input whose data is the JSON text data[0..len) (a span of
 * md_v2_parse_spans) into a named array, as md_v2_decode_array reads it;
 * `in` (borrowed) gives its name, shape and datatype. Thread-safe. */
md_status md_v2_text_array(json_t *in, const char *data, size_t len, size_t max_values,
                           md_array *out, md_err *err);
/* One V2 input (its JSON object `in`, borrowed) into a named array: integer
 * datatypes (INT*, UINT*, BOOL) as int64, exactly (JSON data must hold
 * integers; UINT64 past int64's range refused), float ones as float32 as
 * md_v2_decode reads them. `bytes` (nbytes): its binary data, or NULL for
 * JSON "data". Errors name the input. Thread-safe. */
md_status md_v2_decode_array(json_t *in, const void *bytes, size_t nbytes, size_t max_values,
                             md_array *out, md_err *err);

/* One member of an NPZ archive, as its checked directory says. */
typedef struct md_npz_entry {
    char name[MD_IO_NAME_MAX]; /* without ".npy" */
    int deflated;
    uint32_t crc;
    uint64_t csize, usize;     /* its bytes in the archive, and as an NPY file */
    uint64_t offset;           /* where its bytes start in the archive */
} md_npz_entry;

/* The members of the NPZ archive data[0..len) (a dataset file, mapped),
 * checked as md_npz_decode checks them (names, local headers, sizes that
 * deflate can make), nothing inflated: into list[0..*n) (room for
 * MD_MAX_IO). Thread-safe. */
md_status md_npz_list(const char *data, size_t len, md_npz_entry *list, int *n, md_err *err);

/* One NPY file (a request body) as a named array (name ""), its integers
 * exact, as md_npz_decode reads each member. Thread-safe. */
md_status md_npy_decode_array(const char *data, size_t len, size_t max_values, md_array *out,
                              md_err *err);

/* Decode an NPY file (float32/64, int64/32, uint8, bool; C order) into float32. */
md_status md_npy_decode(const char *data, size_t len, size_t max_values, md_tensor *out,
                        md_err *err);

/* The start of an NPY file, as md_npy_preamble reads it. */
typedef enum md_npy_pre_status {
    MD_NPY_PRE_OK = 0,
    MD_NPY_PRE_NOT_NPY, /* fewer than 10 bytes, or no \x93NUMPY magic */
    MD_NPY_PRE_VERSION, /* a format version other than 1, 2 or 3 (in *version) */
    MD_NPY_PRE_MORE,    /* versions 2 and 3 need 12 bytes: read 2 more, call again */
    MD_NPY_PRE_LARGE,   /* the header is longer than MD_NPY_HEADER_MAX (in *header_len) */
} md_npy_pre_status;

/* The longest NPY header (the dict) read; numpy writes well under 1 KiB. */
#define MD_NPY_HEADER_MAX 65536

/* Parse the preamble of an NPY file from its first `n` bytes `pre`: the
 * magic, the format version (*version, set once the magic matched) and the
 * header's length (*header_len) and offset (*header_off: 10 or 12). The one
 * reader of it, for request bodies (md_npy_decode) and dataset files
 * (jobs/readers.c), each wording its own message from the status. Pure;
 * thread-safe. */
md_npy_pre_status md_npy_preamble(const unsigned char *pre, size_t n, int *version,
                                  size_t *header_len, size_t *header_off);

typedef enum md_npy_dict_status {
    MD_NPY_DICT_OK = 0,
    MD_NPY_DICT_KEYS,      /* descr, fortran_order or shape is missing */
    MD_NPY_DICT_FORTRAN,   /* fortran_order is not False */
    MD_NPY_DICT_NO_SHAPE,  /* shape has no "(" */
    MD_NPY_DICT_SHAPE,     /* a dim is not a number >= 0, more than MD_MAX_DIMS, no ")" */
} md_npy_dict_status;

/* What an NPY header's dict says, as md_npy_parse_dict reads it. */
typedef struct md_npy_dict {
    char descr[16];               /* the dtype string, e.g. "<f4"; "" when unreadable */
    /* the shape's own status: callers check it after the dtype, so a header
     * wrong in both is reported for its dtype, as before the parser was shared */
    md_npy_dict_status shape_status;
    int ndim;
    int64_t shape[MD_MAX_DIMS];   /* each >= 0; their product is not checked here */
} md_npy_dict;

/* Parse the dict of an NPY header (the NUL-terminated text after the
 * preamble): the one parser of it, for request bodies (md_npy_decode) and
 * dataset files (jobs/readers.c), each wording its own message from the
 * statuses. Returns MD_NPY_DICT_KEYS, MD_NPY_DICT_FORTRAN or MD_NPY_DICT_OK;
 * the shape's status is out->shape_status. Which dtypes are accepted is the
 * caller's choice. Thread-safe. */
md_npy_dict_status md_npy_parse_dict(const char *header, md_npy_dict *out);

/* Encode `count` float32 values of `shape` as an NPY (<f4) file. Returns a
 * new malloc'd buffer and its length in *len. */
char *md_npy_encode(const float *data, const int64_t *shape, int ndim, size_t *len);

/* The product of dims[0..ndim) into *out: 0, or -1 when a dim is negative or
 * the product overflows int64. Thread-safe. */
int md_shape_product(const int64_t *dims, int ndim, int64_t *out);

/*
 * The indices of the k largest of x[0..n), best first, into idx (room for
 * min(k, n)); returns how many were written, min(k, n). Equal values rank by
 * lower index first; NaN ranks below every number (NaNs among themselves by
 * index). O(n log k) time, no allocation. Thread-safe.
 */
int64_t md_top_k(const float *x, int64_t n, int64_t k, int64_t *idx);

/* Append the shortest decimal that reads back as the same float32. */
int md_float_format(float v, char *buf, size_t size);

#ifdef __cplusplus
}
#endif
#endif
