/*
 * pickle.c - a restricted unpickler for torch.save's data.pkl: it reads the
 * state_dict a training loop saved without running any code from the file.
 *
 * Over 800 lines on purpose: the opcode interpreter, its value arena and the
 * allow-listed globals are one machine (every opcode builds arena values and
 * GLOBAL/REDUCE are where the allow-list acts); a split would put the
 * security boundary across a file line for no reader's gain.
 *
 * DESIGN
 * A pickle is a program for a small stack machine; Python's unpickler runs it
 * and lets it import and call any global (`os.system` is one GLOBAL and one
 * REDUCE away). This one interprets only the opcodes torch.save emits
 * (protocol 2, plus the few protocol 3/4 ones that cost nothing) and knows
 * the *meaning* of an allow-list of globals instead of calling anything:
 *
 *   collections.OrderedDict         REDUCE with () -> an empty dict; BUILD with
 *                                   its state (the `_metadata` attribute) is
 *                                   accepted and ignored
 *   torch.<T>Storage                only as the type inside a persistent id
 *   torch._utils._rebuild_tensor_v2 REDUCE -> a tensor view of a storage
 *   torch._utils._rebuild_parameter REDUCE -> that tensor (nn.Parameter)
 *
 * Any other GLOBAL fails on the spot with MD_EUNPROC naming it, so nothing
 * after it is even read. A persistent id ('storage', torch.<T>Storage, key,
 * location, numel) fetches record data/<key> through the caller's callback
 * and checks numel x element size against the record's size; a tensor view
 * (offset, size, stride) is checked to lie inside its storage (all in
 * checked 64-bit arithmetic) when it is built, so even tensors later skipped
 * (optimizer state) were checked.
 *
 * Values live in an arena freed at once at the end: the memo (BINGET) makes
 * the value graph a DAG, or even cyclic (a list appended to itself), so no
 * value has a single owner. The result is interpreted only two levels deep
 * (top dict -> state_dict -> tensors), never by recursion over the graph.
 * Every size that comes from the file is bounded: data.pkl, strings, the
 * stack, MARK nesting, memo slots, arena bytes, tensor count and bytes.
 */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"

typedef enum vkind {
    V_NONE,
    V_BOOL,
    V_INT,
    V_BIGINT, /* a LONG1 wider than 64 bits: kept only to be skipped */
    V_FLOAT,
    V_STR,
    V_BYTES,
    V_TUPLE,
    V_LIST,
    V_DICT,
    V_GLOBAL,
    V_STORAGE,
    V_TENSOR,
} vkind;

static const char *const kind_names[] = {
    "None", "bool", "int", "int", "float", "str", "bytes", "tuple", "list", "dict",
    "global", "storage", "tensor",
};

typedef enum gid { G_ORDERED_DICT, G_REBUILD_TENSOR, G_REBUILD_PARAMETER, G_STORAGE } gid;

typedef struct value value;
struct value {
    vkind kind;
    union {
        long long i; /* V_BOOL, V_INT */
        double f;
        struct {
            char *s;
            size_t len;
        } str; /* V_STR, V_BYTES */
        struct {
            value **items; /* V_TUPLE, V_LIST; V_DICT: key, value, key, value... */
            size_t count, cap;
        } seq;
        struct {
            gid id;
            md_ckpt_dtype dtype; /* G_STORAGE */
            const char *name;    /* for messages */
        } global;
        struct {
            md_ckpt_dtype dtype;
            const uint8_t *data; /* borrowed from the record callback */
            long long numel;
            const char *key;
        } storage;
        struct {
            value *storage;
            long long offset;
            int ndim;
            int64_t size[MD_CKPT_MAX_NDIM];
            int64_t stride[MD_CKPT_MAX_NDIM];
        } tensor;
    } u;
};

typedef struct chunk {
    struct chunk *next;
    size_t used, size;
    _Alignas(16) unsigned char mem[];
} chunk;

typedef struct unpickler {
    const uint8_t *p;
    size_t len, pos;
    const char *what;
    md_ckpt_record_fn record;
    void *ctx;
    md_err *err;
    chunk *chunks;
    long long arena_bytes;
    value **stack;
    size_t sp, stack_cap;
    size_t marks[MD_PICKLE_MAX_MARKS];
    size_t nmarks;
    value **memo;
    size_t memo_cap, memo_count; /* slots allocated, slots filled (MEMOIZE's next index) */
    long long tensors;
    const md_ckpt_budget *budget; /* NULL: MD_CKPT_MAX_TOTAL_BYTES */
    md_ckpt_tensor_fn each; /* md_ckpt_unpickle_each: tensors go here, not into a list */
    void *each_ctx;
    int each_data;
} unpickler;

static value none_value = {.kind = V_NONE};

/* Fail with MD_EUNPROC: "<what>: <message> (data.pkl byte N)". */
static md_status fail(unpickler *u, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static md_status fail(unpickler *u, const char *fmt, ...)
{
    char msg[MD_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return md_err_set(u->err, MD_EUNPROC, "%s: %s (data.pkl byte %zu)", u->what, msg, u->pos);
}

static void *arena_alloc(unpickler *u, size_t size)
{
    size = (size + 15) & ~(size_t)15;
    if (!u->chunks || u->chunks->size - u->chunks->used < size) {
        size_t csize = size > 65536 ? size : 65536;
        if ((long long)csize > MD_PICKLE_MAX_ARENA - u->arena_bytes) {
            md_err_set(u->err, MD_ETOOBIG, "%s: data.pkl needs more than %lld bytes of memory to "
                       "read; the limit is MD_PICKLE_MAX_ARENA", u->what,
                       (long long)MD_PICKLE_MAX_ARENA);
            return NULL;
        }
        chunk *c = malloc(sizeof(chunk) + csize);
        if (!c) {
            md_err_set(u->err, MD_ENOMEM, "%s: out of memory reading data.pkl", u->what);
            return NULL;
        }
        c->next = u->chunks;
        c->used = 0;
        c->size = csize;
        u->chunks = c;
        u->arena_bytes += (long long)csize;
    }
    void *p = u->chunks->mem + u->chunks->used;
    u->chunks->used += size;
    return p;
}

static value *new_value(unpickler *u, vkind kind)
{
    value *v = arena_alloc(u, sizeof *v);
    if (v) {
        memset(v, 0, sizeof *v);
        v->kind = kind;
    }
    return v;
}

/* Append to a tuple, list or dict's item array. */
static int seq_push(unpickler *u, value *seq, value *item)
{
    if (seq->u.seq.count == seq->u.seq.cap) {
        size_t cap = seq->u.seq.cap ? seq->u.seq.cap * 2 : 8;
        value **items = arena_alloc(u, cap * sizeof *items);
        if (!items)
            return -1;
        if (seq->u.seq.count)
            memcpy(items, seq->u.seq.items, seq->u.seq.count * sizeof *items);
        seq->u.seq.items = items;
        seq->u.seq.cap = cap;
    }
    seq->u.seq.items[seq->u.seq.count++] = item;
    return 0;
}

static int push(unpickler *u, value *v)
{
    if (!v)
        return -1;
    if (u->sp == u->stack_cap) {
        if (u->sp >= MD_PICKLE_MAX_STACK) {
            fail(u, "the unpickler's stack grew past %d values (MD_PICKLE_MAX_STACK)",
                 MD_PICKLE_MAX_STACK);
            return -1;
        }
        size_t cap = u->stack_cap ? u->stack_cap * 2 : 64;
        value **s = realloc(u->stack, cap * sizeof *s);
        if (!s) {
            md_err_set(u->err, MD_ENOMEM, "%s: out of memory reading data.pkl", u->what);
            return -1;
        }
        u->stack = s;
        u->stack_cap = cap;
    }
    u->stack[u->sp++] = v;
    return 0;
}

/* The values above the innermost MARK must be at least `n`. */
static value *pop(unpickler *u)
{
    size_t floor = u->nmarks ? u->marks[u->nmarks - 1] : 0;
    if (u->sp <= floor) {
        fail(u, "the pickle pops from an empty stack; the file is corrupt");
        return NULL;
    }
    return u->stack[--u->sp];
}

static value *top(unpickler *u)
{
    size_t floor = u->nmarks ? u->marks[u->nmarks - 1] : 0;
    if (u->sp <= floor) {
        fail(u, "the pickle reads an empty stack; the file is corrupt");
        return NULL;
    }
    return u->stack[u->sp - 1];
}

/* Pop to the innermost MARK: the values above it are u->stack[*first..sp). */
static int pop_mark(unpickler *u, size_t *first)
{
    if (!u->nmarks) {
        fail(u, "the pickle closes a MARK it never opened; the file is corrupt");
        return -1;
    }
    *first = u->marks[--u->nmarks];
    return 0;
}

/* APPENDS and SETITEMS: the container is the value just below the MARK. */
static value *below_mark(unpickler *u, size_t first)
{
    size_t floor = u->nmarks ? u->marks[u->nmarks - 1] : 0;
    if (first <= floor) {
        fail(u, "APPENDS or SETITEMS without a container below its MARK; the file is corrupt");
        return NULL;
    }
    return u->stack[first - 1];
}

static int need(unpickler *u, size_t n)
{
    if (u->len - u->pos < n) {
        fail(u, "data.pkl ends in the middle of an opcode; the file is truncated");
        return -1;
    }
    return 0;
}

static uint64_t read_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static value *new_string(unpickler *u, vkind kind, size_t n)
{
    if (n > MD_PICKLE_MAX_STRING) {
        fail(u, "a pickled string is %zu bytes long; the limit is %d (MD_PICKLE_MAX_STRING)", n,
             MD_PICKLE_MAX_STRING);
        return NULL;
    }
    if (need(u, n) < 0)
        return NULL;
    value *v = new_value(u, kind);
    char *s = v ? arena_alloc(u, n + 1) : NULL;
    if (!s)
        return NULL;
    memcpy(s, u->p + u->pos, n);
    s[n] = 0;
    u->pos += n;
    v->u.str.s = s;
    v->u.str.len = n;
    return v;
}

/* A printable copy of bytes from the file for a message (never raw bytes). */
static void printable(char *out, size_t size, const char *s, size_t len)
{
    size_t o = 0;
    for (size_t i = 0; i < len && o + 5 < size; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\')
            out[o++] = (char)c;
        else
            o += (size_t)snprintf(out + o, size - o, "\\x%02x", c);
    }
    out[o < size ? o : size - 1] = 0;
}

static const struct {
    const char *name;
    md_ckpt_dtype dtype;
} storages[] = {
    {"FloatStorage", MD_CKPT_F32}, {"HalfStorage", MD_CKPT_F16},
    {"BFloat16Storage", MD_CKPT_BF16}, {"DoubleStorage", MD_CKPT_F64},
    {"LongStorage", MD_CKPT_I64},  {"IntStorage", MD_CKPT_I32},
    {"ShortStorage", MD_CKPT_I16}, {"CharStorage", MD_CKPT_I8},
    {"ByteStorage", MD_CKPT_U8},   {"BoolStorage", MD_CKPT_BOOL},
};

/* The allow-list: a value standing for global `module`.`name`, or a failure
 * naming it. */
static value *global(unpickler *u, const char *module, size_t mlen, const char *name, size_t nlen)
{
    value *v = new_value(u, V_GLOBAL);
    if (!v)
        return NULL;
    if (mlen == 11 && memcmp(module, "collections", 11) == 0 && nlen == 11 &&
        memcmp(name, "OrderedDict", 11) == 0) {
        v->u.global.id = G_ORDERED_DICT;
        v->u.global.name = "collections.OrderedDict";
        return v;
    }
    if (mlen == 12 && memcmp(module, "torch._utils", 12) == 0) {
        if (nlen == 18 && memcmp(name, "_rebuild_tensor_v2", 18) == 0) {
            v->u.global.id = G_REBUILD_TENSOR;
            v->u.global.name = "torch._utils._rebuild_tensor_v2";
            return v;
        }
        if (nlen == 18 && memcmp(name, "_rebuild_parameter", 18) == 0) {
            v->u.global.id = G_REBUILD_PARAMETER;
            v->u.global.name = "torch._utils._rebuild_parameter";
            return v;
        }
    }
    if (mlen == 5 && memcmp(module, "torch", 5) == 0)
        for (size_t i = 0; i < sizeof storages / sizeof storages[0]; i++)
            if (strlen(storages[i].name) == nlen && memcmp(name, storages[i].name, nlen) == 0) {
                v->u.global.id = G_STORAGE;
                v->u.global.dtype = storages[i].dtype;
                v->u.global.name = storages[i].name;
                return v;
            }
    char m[128], n[128];
    printable(m, sizeof m, module, mlen);
    printable(n, sizeof n, name, nlen);
    if (mlen == 5 && memcmp(module, "torch", 5) == 0 && nlen > 7 &&
        memcmp(name + nlen - 7, "Storage", 7) == 0)
        fail(u, "tensors of type torch.%s are not supported in a checkpoint; save float, "
             "integer or bool tensors", n);
    else if (mlen == 8 && memcmp(module, "__main__", 8) == 0)
        fail(u, "global %s.%s is not allowed in a checkpoint: the file pickles a Python object "
             "(a whole model?), not a state_dict; save model.state_dict() instead, no code "
             "from a checkpoint is ever run", m, n);
    else
        fail(u, "global %s.%s is not allowed in a checkpoint; only state_dicts (dicts of "
             "tensors, numbers and strings) are read and no code from the file is run: save "
             "model.state_dict() or a safetensors file", m, n);
    return NULL;
}

/* GLOBAL: "module\nname\n". */
static value *read_global(unpickler *u)
{
    const char *line[2];
    size_t n[2];
    for (int k = 0; k < 2; k++) {
        const uint8_t *start = u->p + u->pos;
        size_t avail = u->len - u->pos, max = avail < 256 ? avail : 256;
        const uint8_t *nl = memchr(start, '\n', max);
        if (!nl) {
            fail(u, "a GLOBAL name is unterminated or longer than 255 bytes");
            return NULL;
        }
        line[k] = (const char *)start;
        n[k] = (size_t)(nl - start);
        u->pos += n[k] + 1;
    }
    return global(u, line[0], n[0], line[1], n[1]);
}

static int as_int(unpickler *u, value *v, const char *what, long long *out)
{
    if (!v || (v->kind != V_INT && v->kind != V_BOOL)) {
        fail(u, "%s is a %s, not an int", what, v ? kind_names[v->kind] : "nothing");
        return -1;
    }
    *out = v->u.i;
    return 0;
}

/* BINPERSID: ('storage', torch.<T>Storage, key, location, numel). */
static value *persistent_load(unpickler *u, value *pid)
{
    if (pid->kind != V_TUPLE || pid->u.seq.count != 5 || pid->u.seq.items[0]->kind != V_STR ||
        strcmp(pid->u.seq.items[0]->u.str.s, "storage") != 0) {
        fail(u, "a persistent id is not ('storage', type, key, location, numel)");
        return NULL;
    }
    value **it = pid->u.seq.items;
    if (it[1]->kind != V_GLOBAL || it[1]->u.global.id != G_STORAGE) {
        fail(u, "a storage's type is a %s, not torch.<T>Storage", kind_names[it[1]->kind]);
        return NULL;
    }
    if (it[2]->kind != V_STR || it[2]->u.str.len == 0 || it[2]->u.str.len > 64) {
        fail(u, "a storage's key is not a short string");
        return NULL;
    }
    for (size_t i = 0; i < it[2]->u.str.len; i++) {
        char c = it[2]->u.str.s[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              c == '_')) {
            char k[300];
            printable(k, sizeof k, it[2]->u.str.s, it[2]->u.str.len);
            fail(u, "storage key \"%s\" is not a record name (letters, digits, _)", k);
            return NULL;
        }
    }
    long long numel;
    if (as_int(u, it[4], "a storage's element count", &numel) < 0)
        return NULL;
    md_ckpt_dtype dtype = it[1]->u.global.dtype;
    const uint8_t *data = NULL;
    size_t size = 0;
    if (!u->record) {
        fail(u, "the pickle names storage data/%s, but no storage records were given",
             it[2]->u.str.s);
        return NULL;
    }
    md_status st = u->record(u->ctx, it[2]->u.str.s, &data, &size, u->err);
    if (st != MD_OK)
        return NULL;
    unsigned long long bytes;
    if (numel < 0 ||
        __builtin_mul_overflow((unsigned long long)numel, md_ckpt_dtype_size(dtype), &bytes) ||
        bytes > size) {
        fail(u, "storage data/%s claims %lld elements of %s (%zu bytes each), but the record "
             "holds %zu bytes", it[2]->u.str.s, numel, md_ckpt_dtype_name(dtype),
             md_ckpt_dtype_size(dtype), size);
        return NULL;
    }
    value *v = new_value(u, V_STORAGE);
    if (!v)
        return NULL;
    v->u.storage.dtype = dtype;
    v->u.storage.data = data;
    v->u.storage.numel = numel;
    v->u.storage.key = it[2]->u.str.s;
    return v;
}

/* _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]) */
static value *rebuild_tensor(unpickler *u, value *args)
{
    if (args->u.seq.count != 6 && args->u.seq.count != 7) {
        fail(u, "_rebuild_tensor_v2 takes 6 or 7 arguments, the file passes %zu",
             args->u.seq.count);
        return NULL;
    }
    value **a = args->u.seq.items;
    if (a[0]->kind != V_STORAGE) {
        fail(u, "_rebuild_tensor_v2's storage is a %s", kind_names[a[0]->kind]);
        return NULL;
    }
    long long offset;
    if (as_int(u, a[1], "a tensor's storage offset", &offset) < 0)
        return NULL;
    if (a[2]->kind != V_TUPLE || a[3]->kind != V_TUPLE ||
        a[2]->u.seq.count != a[3]->u.seq.count) {
        fail(u, "a tensor's size and stride are not two tuples of the same length");
        return NULL;
    }
    size_t ndim = a[2]->u.seq.count;
    if (ndim > MD_CKPT_MAX_NDIM) {
        fail(u, "a tensor has %zu dimensions; at most %d are supported", ndim, MD_CKPT_MAX_NDIM);
        return NULL;
    }
    if (++u->tensors > MD_CKPT_MAX_TENSORS) {
        fail(u, "more than %d tensors (MD_CKPT_MAX_TENSORS)", MD_CKPT_MAX_TENSORS);
        return NULL;
    }
    value *t = new_value(u, V_TENSOR);
    if (!t)
        return NULL;
    value *storage = a[0];
    t->u.tensor.storage = storage;
    t->u.tensor.offset = offset;
    t->u.tensor.ndim = (int)ndim;
    /* the last element a view reaches: offset + sum (size_i - 1) * stride_i */
    int empty = 0;
    long long last = offset;
    int bad = offset < 0;
    for (size_t d = 0; d < ndim; d++) {
        long long size, stride, step;
        if (as_int(u, a[2]->u.seq.items[d], "a tensor's size", &size) < 0 ||
            as_int(u, a[3]->u.seq.items[d], "a tensor's stride", &stride) < 0)
            return NULL;
        if (size < 0 || stride < 0) {
            fail(u, "a tensor has a negative size or stride (%lld, %lld) in dimension %zu",
                 size, stride, d);
            return NULL;
        }
        t->u.tensor.size[d] = size;
        t->u.tensor.stride[d] = stride;
        if (size == 0)
            empty = 1;
        else if (__builtin_mul_overflow(size - 1, stride, &step) ||
                 __builtin_add_overflow(last, step, &last))
            bad = 1;
    }
    if (bad || (empty ? offset > storage->u.storage.numel : last >= storage->u.storage.numel)) {
        fail(u, "a tensor view (offset %lld, %zu dimensions) reaches past the end of storage "
             "data/%s, which holds %lld elements", offset, ndim, storage->u.storage.key,
             storage->u.storage.numel);
        return NULL;
    }
    return t;
}

static value *reduce(unpickler *u, value *callable, value *args)
{
    if (callable->kind != V_GLOBAL) {
        fail(u, "REDUCE calls a %s; only allow-listed globals can be called",
             kind_names[callable->kind]);
        return NULL;
    }
    if (args->kind != V_TUPLE) {
        fail(u, "REDUCE's arguments are a %s, not a tuple", kind_names[args->kind]);
        return NULL;
    }
    switch (callable->u.global.id) {
    case G_ORDERED_DICT:
        if (args->u.seq.count != 0) {
            fail(u, "collections.OrderedDict is called with arguments; torch.save never does");
            return NULL;
        }
        return new_value(u, V_DICT);
    case G_REBUILD_TENSOR:
        return rebuild_tensor(u, args);
    case G_REBUILD_PARAMETER:
        if (args->u.seq.count != 3 || args->u.seq.items[0]->kind != V_TENSOR) {
            fail(u, "_rebuild_parameter's arguments are not (tensor, requires_grad, hooks)");
            return NULL;
        }
        return args->u.seq.items[0];
    case G_STORAGE:
        break;
    }
    fail(u, "torch.%s is called; torch.save never calls a storage type",
         callable->u.global.name);
    return NULL;
}

static value *make_tuple(unpickler *u, size_t first)
{
    value *t = new_value(u, V_TUPLE);
    if (!t)
        return NULL;
    for (size_t i = first; i < u->sp; i++)
        if (seq_push(u, t, u->stack[i]) < 0)
            return NULL;
    u->sp = first;
    return t;
}

static int memo_put(unpickler *u, uint64_t index, value *v)
{
    if (!v)
        return -1;
    if (index >= MD_PICKLE_MAX_MEMO) {
        fail(u, "memo index %llu is past the limit of %d slots (MD_PICKLE_MAX_MEMO)",
             (unsigned long long)index, MD_PICKLE_MAX_MEMO);
        return -1;
    }
    if (index >= u->memo_cap) {
        size_t cap = u->memo_cap ? u->memo_cap : 64;
        while (cap <= index)
            cap *= 2;
        value **m = realloc(u->memo, cap * sizeof *m);
        if (!m) {
            md_err_set(u->err, MD_ENOMEM, "%s: out of memory reading data.pkl", u->what);
            return -1;
        }
        memset(m + u->memo_cap, 0, (cap - u->memo_cap) * sizeof *m);
        u->memo = m;
        u->memo_cap = cap;
    }
    if (!u->memo[index])
        u->memo_count++;
    u->memo[index] = v;
    return 0;
}

static value *memo_get(unpickler *u, uint64_t index)
{
    if (index >= u->memo_cap || !u->memo[index]) {
        fail(u, "memo slot %llu is read before it was written; the file is corrupt",
             (unsigned long long)index);
        return NULL;
    }
    return u->memo[index];
}

/* Add items stack[first..sp) as key, value pairs to dict `d`. */
static int set_items(unpickler *u, value *d, size_t first)
{
    if (d->kind != V_DICT) {
        fail(u, "SETITEM on a %s, not a dict", kind_names[d->kind]);
        return -1;
    }
    if ((u->sp - first) % 2) {
        fail(u, "SETITEMS with an odd number of values");
        return -1;
    }
    for (size_t i = first; i < u->sp; i++)
        if (seq_push(u, d, u->stack[i]) < 0)
            return -1;
    u->sp = first;
    return 0;
}

/* Run the pickle to STOP; the result in *result. */
static int run(unpickler *u, value **result)
{
    value *v, *w;
    size_t first;
    if (u->len > MD_PICKLE_MAX_BYTES)
        return md_err_set(u->err, MD_ETOOBIG, "%s: data.pkl is %zu bytes; the limit is %d "
                          "(MD_PICKLE_MAX_BYTES)", u->what, u->len, MD_PICKLE_MAX_BYTES), -1;
    for (;;) {
        if (need(u, 1) < 0)
            return -1;
        uint8_t op = u->p[u->pos++];
        switch (op) {
        case 0x80: /* PROTO */
            if (need(u, 1) < 0)
                return -1;
            if (u->p[u->pos] < 2 || u->p[u->pos] > 5)
                return fail(u, "pickle protocol %d; torch.save writes protocol 2",
                            u->p[u->pos]), -1;
            u->pos++;
            break;
        case 0x95: /* FRAME: an 8-byte length, a hint only */
            if (need(u, 8) < 0)
                return -1;
            u->pos += 8;
            break;
        case '.': /* STOP */
            if (!(*result = pop(u)))
                return -1;
            return 0;
        case '(': /* MARK */
            if (u->nmarks == MD_PICKLE_MAX_MARKS)
                return fail(u, "MARKs nest deeper than %d (MD_PICKLE_MAX_MARKS)",
                            MD_PICKLE_MAX_MARKS), -1;
            u->marks[u->nmarks++] = u->sp;
            break;
        case '0': /* POP */
            if (!pop(u))
                return -1;
            break;
        case '1': /* POP_MARK */
            if (pop_mark(u, &first) < 0)
                return -1;
            u->sp = first;
            break;
        case '2': /* DUP */
            if (!(v = top(u)) || push(u, v) < 0)
                return -1;
            break;
        case 'N':
            if (push(u, &none_value) < 0)
                return -1;
            break;
        case 0x88: /* NEWTRUE */
        case 0x89: /* NEWFALSE */
            if (!(v = new_value(u, V_BOOL)))
                return -1;
            v->u.i = op == 0x88;
            if (push(u, v) < 0)
                return -1;
            break;
        case 'J': /* BININT */
        case 'K': /* BININT1 */
        case 'M': /* BININT2 */
        {
            int n = op == 'J' ? 4 : op == 'K' ? 1 : 2;
            if (need(u, (size_t)n) < 0 || !(v = new_value(u, V_INT)))
                return -1;
            uint64_t x = read_le(u->p + u->pos, n);
            v->u.i = op == 'J' ? (long long)(int32_t)(uint32_t)x : (long long)x;
            u->pos += (size_t)n;
            if (push(u, v) < 0)
                return -1;
            break;
        }
        case 0x8a: /* LONG1: n bytes, two's complement little-endian */
        {
            if (need(u, 1) < 0)
                return -1;
            size_t n = u->p[u->pos++];
            if (need(u, n) < 0)
                return -1;
            if (n > 8) {
                v = new_value(u, V_BIGINT);
            } else if ((v = new_value(u, V_INT))) {
                uint64_t x = n ? read_le(u->p + u->pos, (int)n) : 0;
                if (n && n < 8 && (u->p[u->pos + n - 1] & 0x80))
                    x |= ~(uint64_t)0 << (8 * n); /* sign-extend */
                v->u.i = (long long)x;
            }
            u->pos += n;
            if (push(u, v) < 0)
                return -1;
            break;
        }
        case 'G': /* BINFLOAT: big-endian double */
        {
            if (need(u, 8) < 0 || !(v = new_value(u, V_FLOAT)))
                return -1;
            uint64_t x = 0;
            for (int i = 0; i < 8; i++)
                x = x << 8 | u->p[u->pos + (size_t)i];
            memcpy(&v->u.f, &x, sizeof x);
            u->pos += 8;
            if (push(u, v) < 0)
                return -1;
            break;
        }
        case 'X':    /* BINUNICODE: 4-byte length */
        case 0x8c:   /* SHORT_BINUNICODE: 1-byte length */
        case 0x8d:   /* BINUNICODE8 */
        case 'B':    /* BINBYTES */
        case 'C':    /* SHORT_BINBYTES */
        case 0x8e: { /* BINBYTES8 */
            int n = (op == 'X' || op == 'B') ? 4 : (op == 0x8c || op == 'C') ? 1 : 8;
            if (need(u, (size_t)n) < 0)
                return -1;
            uint64_t len = read_le(u->p + u->pos, n);
            u->pos += (size_t)n;
            if (len > MD_PICKLE_MAX_STRING)
                return fail(u, "a pickled string is %llu bytes long; the limit is %d "
                            "(MD_PICKLE_MAX_STRING)", (unsigned long long)len,
                            MD_PICKLE_MAX_STRING), -1;
            vkind k = (op == 'X' || op == 0x8c || op == 0x8d) ? V_STR : V_BYTES;
            if (push(u, new_string(u, k, (size_t)len)) < 0)
                return -1;
            break;
        }
        case '}': /* EMPTY_DICT */
        case ']': /* EMPTY_LIST */
        case ')': /* EMPTY_TUPLE */
            if (push(u, new_value(u, op == '}' ? V_DICT : op == ']' ? V_LIST : V_TUPLE)) < 0)
                return -1;
            break;
        case 't': /* TUPLE */
            if (pop_mark(u, &first) < 0 || push(u, make_tuple(u, first)) < 0)
                return -1;
            break;
        case 0x85: /* TUPLE1 */
        case 0x86: /* TUPLE2 */
        case 0x87: /* TUPLE3 */
        {
            size_t n = (size_t)(op - 0x84);
            size_t floor = u->nmarks ? u->marks[u->nmarks - 1] : 0;
            if (u->sp - floor < n)
                return fail(u, "TUPLE%zu with fewer values on the stack", n), -1;
            if (push(u, make_tuple(u, u->sp - n)) < 0)
                return -1;
            break;
        }
        case 'a': /* APPEND */
            if (!(v = pop(u)) || !(w = top(u)))
                return -1;
            if (w->kind != V_LIST)
                return fail(u, "APPEND to a %s, not a list", kind_names[w->kind]), -1;
            if (seq_push(u, w, v) < 0)
                return -1;
            break;
        case 'e': /* APPENDS */
            if (pop_mark(u, &first) < 0 || !(w = below_mark(u, first)))
                return -1;
            if (w->kind != V_LIST)
                return fail(u, "APPENDS to a %s, not a list", kind_names[w->kind]), -1;
            for (size_t i = first; i < u->sp; i++)
                if (seq_push(u, w, u->stack[i]) < 0)
                    return -1;
            u->sp = first;
            break;
        case 's': /* SETITEM */
        {
            size_t floor = u->nmarks ? u->marks[u->nmarks - 1] : 0;
            if (u->sp - floor < 3)
                return fail(u, "SETITEM with fewer than 3 values on the stack"), -1;
            if (set_items(u, u->stack[u->sp - 3], u->sp - 2) < 0)
                return -1;
            break;
        }
        case 'u': /* SETITEMS */
            if (pop_mark(u, &first) < 0 || !(w = below_mark(u, first)) ||
                set_items(u, w, first) < 0)
                return -1;
            break;
        case 'q': /* BINPUT */
        case 'r': /* LONG_BINPUT */
        {
            int n = op == 'q' ? 1 : 4;
            if (need(u, (size_t)n) < 0)
                return -1;
            uint64_t index = read_le(u->p + u->pos, n);
            u->pos += (size_t)n;
            if (memo_put(u, index, top(u)) < 0)
                return -1;
            break;
        }
        case 0x94: /* MEMOIZE: the next free slot (the memo's length) */
            if (memo_put(u, u->memo_count, top(u)) < 0)
                return -1;
            break;
        case 'h': /* BINGET */
        case 'j': /* LONG_BINGET */
        {
            int n = op == 'h' ? 1 : 4;
            if (need(u, (size_t)n) < 0)
                return -1;
            uint64_t index = read_le(u->p + u->pos, n);
            u->pos += (size_t)n;
            if (push(u, memo_get(u, index)) < 0)
                return -1;
            break;
        }
        case 'c': /* GLOBAL */
            if (push(u, read_global(u)) < 0)
                return -1;
            break;
        case 0x93: /* STACK_GLOBAL */
            if (!(w = pop(u)) || !(v = pop(u)))
                return -1;
            if (v->kind != V_STR || w->kind != V_STR)
                return fail(u, "STACK_GLOBAL of a %s and a %s, not two strings",
                            kind_names[v->kind], kind_names[w->kind]), -1;
            if (push(u, global(u, v->u.str.s, v->u.str.len, w->u.str.s, w->u.str.len)) < 0)
                return -1;
            break;
        case 'R': /* REDUCE */
            if (!(v = pop(u)) || !(w = pop(u)) || push(u, reduce(u, w, v)) < 0)
                return -1;
            break;
        case 'b': /* BUILD: only an OrderedDict's attributes (its _metadata) */
            if (!(v = pop(u)) || !(w = top(u)))
                return -1;
            if (w->kind != V_DICT)
                return fail(u, "BUILD sets the state of a %s; only an OrderedDict's "
                            "_metadata is accepted", kind_names[w->kind]), -1;
            break;
        case 'Q': /* BINPERSID */
            if (!(v = pop(u)) || push(u, persistent_load(u, v)) < 0)
                return -1;
            break;
        default:
            u->pos--;
            return fail(u, "pickle opcode 0x%02x is not one torch.save writes; the file is "
                        "not a torch.save checkpoint or is corrupt", op), -1;
        }
    }
}

static const char *str_key(value *k) { return k->kind == V_STR ? k->u.str.s : NULL; }

/* The bytes tensor view `t` copies out to: its shape's product times the
 * element size, in checked arithmetic. -1 (with `u->err` set) when that
 * overflows. */
static int view_bytes(unpickler *u, const char *name, value *t, unsigned long long *bytes)
{
    unsigned long long numel = 1;
    for (int d = 0; d < t->u.tensor.ndim; d++)
        if (__builtin_mul_overflow(numel, (unsigned long long)t->u.tensor.size[d], &numel))
            goto overflow;
    if (__builtin_mul_overflow(numel, md_ckpt_dtype_size(t->u.tensor.storage->u.storage.dtype),
                               bytes))
        goto overflow;
    return 0;
overflow:
    md_err_setc(u->err, MD_ETOOBIG, "checkpoint_too_large",
                "%s: tensor \"%.200s\" has more elements than fit in memory", u->what, name);
    return -1;
}

/* Copy a (possibly strided) view out into a new contiguous buffer of `bytes`
 * (view_bytes, already counted against the read's budget). */
static md_status materialize(unpickler *u, const char *name, value *t, size_t bytes,
                             md_tensors *out)
{
    value *s = t->u.tensor.storage;
    md_ckpt_dtype dtype = s->u.storage.dtype;
    size_t es = md_ckpt_dtype_size(dtype), numel = bytes / es;
    int ndim = t->u.tensor.ndim;
    uint8_t *buf = md_malloc_checked(bytes ? bytes : 1, "checkpoint tensor", u->err);
    if (!buf)
        return MD_ENOMEM;
    const uint8_t *base = s->u.storage.data + (size_t)t->u.tensor.offset * es;
    /* contiguous: C-order strides (dimensions of size 1 may have any stride);
     * with numel > 0 every size is >= 1, so each partial product is at most
     * numel and fits */
    int contiguous = 1;
    size_t expect = 1;
    for (int d = ndim - 1; d >= 0 && numel > 0; d--) {
        if (t->u.tensor.size[d] != 1 && (size_t)t->u.tensor.stride[d] != expect)
            contiguous = 0;
        expect *= (size_t)t->u.tensor.size[d];
    }
    if (numel == 0) {
        /* nothing to copy */
    } else if (contiguous) {
        memcpy(buf, base, bytes);
    } else {
        int64_t idx[MD_CKPT_MAX_NDIM] = {0};
        size_t src = 0; /* element offset from base; in bounds: checked in rebuild_tensor */
        for (size_t i = 0; i < numel; i++) {
            memcpy(buf + i * es, base + src * es, es);
            for (int d = ndim - 1; d >= 0; d--) {
                src += (size_t)t->u.tensor.stride[d];
                if (++idx[d] < t->u.tensor.size[d])
                    break;
                src -= (size_t)t->u.tensor.stride[d] * (size_t)t->u.tensor.size[d];
                idx[d] = 0;
            }
        }
    }
    md_status st = md_tensors_adopt(out, name, dtype, ndim, t->u.tensor.size, buf, bytes, u->err);
    if (st != MD_OK && st != MD_ENOMEM) {
        char msg[MD_ERR_MSG_MAX];
        snprintf(msg, sizeof msg, "%s", u->err->msg);
        md_err_set(u->err, MD_EUNPROC, "%s: %s", u->what, msg);
        return MD_EUNPROC;
    }
    return st;
}

/* md_ckpt_unpickle_each: tensor `t` to the caller's function, copied out
 * alone (a list of one, freed after the call) or without its data. */
static md_status visit(unpickler *u, const char *name, value *t, size_t bytes)
{
    md_ckpt_dtype dtype = t->u.tensor.storage->u.storage.dtype;
    if (!u->each_data)
        return u->each(u->each_ctx, name, dtype, t->u.tensor.ndim, t->u.tensor.size, NULL,
                       bytes, u->err);
    md_tensors *one = md_tensors_new();
    md_status st = materialize(u, name, t, bytes, one);
    if (st == MD_OK)
        st = u->each(u->each_ctx, name, dtype, md_tensors_ndim(one, 0), md_tensors_shape(one, 0),
                     md_tensors_data(one, 0), md_tensors_nbytes(one, 0), u->err);
    md_tensors_free(one);
    return st;
}

/* The value of a one-element tensor (`"loss": loss.detach()` is common). */
static double tensor_number(value *t)
{
    value *s = t->u.tensor.storage;
    const uint8_t *p = s->u.storage.data +
                       (size_t)t->u.tensor.offset * md_ckpt_dtype_size(s->u.storage.dtype);
    union {
        float f;
        double d;
        int64_t i64;
        int32_t i32;
        int16_t i16;
        uint16_t u16;
        uint32_t u32;
    } v;
    memcpy(&v, p, md_ckpt_dtype_size(s->u.storage.dtype));
    switch (s->u.storage.dtype) {
    case MD_CKPT_F32: return v.f;
    case MD_CKPT_F64: return v.d;
    case MD_CKPT_I64: return (double)v.i64;
    case MD_CKPT_I32: return v.i32;
    case MD_CKPT_I16: return v.i16;
    case MD_CKPT_I8: return (int8_t)p[0];
    case MD_CKPT_U8:
    case MD_CKPT_BOOL: return p[0];
    case MD_CKPT_BF16:
        v.u32 = (uint32_t)v.u16 << 16;
        return v.f;
    case MD_CKPT_F16: {
        int e = (v.u16 >> 10) & 31, m = v.u16 & 1023;
        double x = e == 0    ? ldexp(m, -24)
                   : e == 31 ? (m ? NAN : INFINITY)
                             : ldexp(m | 1024, e - 25);
        return v.u16 >> 15 ? -x : x;
    }
    default: return NAN;
    }
}

static unsigned long long budget_bytes(const md_ckpt_budget *b)
{
    unsigned long long max = (unsigned long long)MD_CKPT_MAX_TOTAL_BYTES;
    return b && b->max_bytes && b->max_bytes < max ? b->max_bytes : max;
}

static md_status over_budget(unpickler *u, unsigned long long total)
{
    const md_ckpt_budget *b = u->budget;
    int own = b && b->max_bytes && b->max_bytes < (unsigned long long)MD_CKPT_MAX_TOTAL_BYTES;
    char amount[32] = "";
    if (total == ULLONG_MAX)
        snprintf(amount, sizeof amount, "over 2^64");
    else
        snprintf(amount, sizeof amount, "%llu", total);
    return md_err_setc(u->err, MD_ETOOBIG, "checkpoint_too_large",
                       "%s: its state_dict's tensors would take %s bytes once copied out, more "
                       "than %s (%llu bytes); a saved view is copied out whole "
                       "(torch.zeros(1).expand(n) takes n elements): save the tensors the "
                       "model needs, cloned",
                       u->what, amount,
                       own && b->limit ? b->limit : "the build's limit MD_CKPT_MAX_TOTAL_BYTES",
                       budget_bytes(b));
}

static const char *const wrapper_keys[] = {"model", "state_dict", "model_state_dict"};

/* The state_dict in the unpickled value, its tensors into `out`. */
static md_status extract(unpickler *u, value *root, md_tensors *out)
{
    if (root->kind != V_DICT)
        return md_err_set(u->err, MD_EUNPROC, "%s holds a %s, not a state_dict (a dict of "
                          "tensors); save model.state_dict()", u->what, kind_names[root->kind]);
    value *sd = NULL;
    for (size_t w = 0; w < 3 && !sd; w++)
        for (size_t i = 0; i < root->u.seq.count; i += 2) {
            const char *k = str_key(root->u.seq.items[i]);
            if (k && strcmp(k, wrapper_keys[w]) == 0 &&
                root->u.seq.items[i + 1]->kind == V_DICT) {
                sd = root->u.seq.items[i + 1];
                break;
            }
        }
    if (sd) {
        for (size_t i = 0; i < root->u.seq.count; i += 2) {
            const char *k = str_key(root->u.seq.items[i]);
            value *v = root->u.seq.items[i + 1];
            if (!k || strlen(k) != root->u.seq.items[i]->u.str.len)
                continue;
            if (v->kind == V_INT || v->kind == V_BOOL || v->kind == V_FLOAT)
                md_tensors_set_scalar(out, k, v->kind == V_FLOAT ? v->u.f : (double)v->u.i);
            else if (v->kind == V_TENSOR && v->u.tensor.ndim == 0) /* in bounds: checked */
                md_tensors_set_scalar(out, k, tensor_number(v));
        }
    } else {
        sd = root;
    }
    if (sd->u.seq.count == 0)
        return md_err_set(u->err, MD_EUNPROC, "%s holds an empty dict, not a state_dict with "
                          "tensors", u->what);
    /* every key and value checked, and the bytes of all copies summed against
     * the budget, before the first copy is allocated */
    unsigned long long total = 0;
    for (size_t i = 0; i < sd->u.seq.count; i += 2) {
        value *k = sd->u.seq.items[i], *v = sd->u.seq.items[i + 1];
        if (k->kind != V_STR || strlen(k->u.str.s) != k->u.str.len) {
            return md_err_set(u->err, MD_EUNPROC, "%s: a state_dict key is a %s, not a name%s",
                              u->what, kind_names[k->kind],
                              sd == root ? "; a checkpoint dict should hold the state_dict "
                                           "under \"model\", \"state_dict\" or "
                                           "\"model_state_dict\"" : "");
        }
        if (v->kind != V_TENSOR) {
            char name[200];
            printable(name, sizeof name, k->u.str.s, k->u.str.len);
            return md_err_set(u->err, MD_EUNPROC, "%s: entry \"%s\" is a %s, not a tensor%s",
                              u->what, name, kind_names[v->kind],
                              sd == root ? "; a checkpoint dict should hold the state_dict "
                                           "under \"model\", \"state_dict\" or "
                                           "\"model_state_dict\"" : "");
        }
        unsigned long long bytes;
        if (view_bytes(u, k->u.str.s, v, &bytes) < 0)
            return MD_ETOOBIG;
        if (__builtin_add_overflow(total, bytes, &total))
            total = ULLONG_MAX; /* saturated: past any budget */
    }
    if (total > budget_bytes(u->budget))
        return over_budget(u, total);
    for (size_t i = 0; i < sd->u.seq.count; i += 2) {
        value *k = sd->u.seq.items[i], *v = sd->u.seq.items[i + 1];
        unsigned long long bytes;
        if (view_bytes(u, k->u.str.s, v, &bytes) < 0)
            return MD_ETOOBIG;
        md_status st = u->each ? visit(u, k->u.str.s, v, (size_t)bytes)
                                : materialize(u, k->u.str.s, v, (size_t)bytes, out);
        if (st != MD_OK)
            return st;
    }
    return MD_OK;
}

/* md_ckpt_unpickle, or with `each` md_ckpt_unpickle_each (the list that
 * *out receives then holds only the top-level numbers). */
static md_status unpickle(const uint8_t *pkl, size_t len, md_ckpt_record_fn record, void *ctx,
                          const char *what, const md_ckpt_budget *budget, md_ckpt_tensor_fn each,
                          void *each_ctx, int each_data, md_tensors **out, md_err *err)
{
    *out = NULL;
    md_err local;
    if (!err)
        err = &local;
    md_err_clear(err);
    unpickler u = {.p = pkl, .len = len, .what = what ? what : "the checkpoint",
                   .record = record, .ctx = ctx, .err = err, .budget = budget, .each = each,
                   .each_ctx = each_ctx, .each_data = each_data};
    value *root = NULL;
    md_status st = MD_OK;
    if (len >= 14 && md_ckpt_sniff(pkl, len) == MD_CKPT_LEGACY)
        st = md_err_set(err, MD_EUNPROC, "%s is in the legacy torch.save format; re-save it "
                        "with torch.save(..., _use_new_zipfile_serialization=True)", u.what);
    else if (run(&u, &root) < 0)
        st = err->status != MD_OK ? err->status : MD_EUNPROC;
    md_tensors *t = NULL;
    if (st == MD_OK) {
        t = md_tensors_new();
        st = extract(&u, root, t);
    }
    while (u.chunks) {
        chunk *next = u.chunks->next;
        free(u.chunks);
        u.chunks = next;
    }
    free(u.stack);
    free(u.memo);
    if (st != MD_OK) {
        md_tensors_free(t);
        return st;
    }
    *out = t;
    return MD_OK;
}

md_status md_ckpt_unpickle(const uint8_t *pkl, size_t len, md_ckpt_record_fn record, void *ctx,
                           const char *what, const md_ckpt_budget *budget, md_tensors **out,
                           md_err *err)
{
    return unpickle(pkl, len, record, ctx, what, budget, NULL, NULL, 0, out, err);
}

md_status md_ckpt_unpickle_each(const uint8_t *pkl, size_t len, md_ckpt_record_fn record,
                                void *ctx, const char *what, int with_data, md_ckpt_tensor_fn fn,
                                void *fn_ctx, md_err *err)
{
    md_tensors *numbers = NULL;
    /* one tensor in memory at a time, but each one and their sum still
     * bounded as md_ckpt_unpickle's (an expanded view is one huge tensor) */
    md_status st =
        unpickle(pkl, len, record, ctx, what, NULL, fn, fn_ctx, with_data, &numbers, err);
    md_tensors_free(numbers);
    return st;
}
