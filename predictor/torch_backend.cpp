// torch_backend.cpp - libtorch behind the C header torch_backend.h.
// Every extern "C" body catches everything and reports through md_err.
#include "torch_backend.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>
#include <new>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/script.h>
#include <torch/version.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/xnnpack_rewrite.h>
#include <caffe2/serialize/inline_container.h>
#ifdef WITH_CUDA
/* Only what needs CUDA headers sits here: one stream per worker thread. */
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

struct md_torch_model {
    torch::jit::script::Module module;
    torch::Device device;
    torch::ScalarType dtype;
    std::string device_name;
    md_torch_model(torch::jit::script::Module m, torch::Device d, torch::ScalarType t,
                   std::string name)
        : module(std::move(m)), device(d), dtype(t), device_name(std::move(name))
    {
    }
    /* md_torch_replica: one at a time per model, and its verdict when there
     * is nothing to pack (-1), so later workers skip the freeze */
    mutable std::mutex replica_mu;
    mutable int replica_verdict = 0;
    mutable size_t verdict_bytes = 0;
};

static torch::ScalarType scalar_type(md_dtype d)
{
    switch (d) {
    case MD_F64:
        return torch::kFloat64;
    case MD_I64:
        return torch::kInt64;
    case MD_U8:
        return torch::kUInt8;
    case MD_I32:
        return torch::kInt32;
    case MD_BOOL:
        return torch::kBool;
    default:
        return torch::kFloat32;
    }
}

/*
 * libtorch's messages are long: a TorchScript interpreter failure starts with
 * "The following operation failed in the TorchScript interpreter." and ends,
 * after two tracebacks, with the line that says why ("RuntimeError: mat1 and
 * mat2 shapes cannot be multiplied (1x3 and 4x2)"); a c10::Error may carry a
 * C++ backtrace after its first line. The answer gets the reason and the
 * TorchScript operation that raised it; the log gets the whole message, on
 * one line (newlines escaped, so it cannot forge log lines).
 */
static bool is_reason_line(const std::string &l)
{
    /* "RuntimeError: ...", "torch.jit.Error: ...", "builtins.ValueError: ..." */
    size_t colon = l.find(": ");
    if (colon == std::string::npos || colon == 0 || l[0] == ' ')
        return false;
    std::string head = l.substr(0, colon);
    for (char c : head)
        if (!(isalnum((unsigned char)c) || c == '_' || c == '.'))
            return false;
    return head.size() >= 5 && (head.compare(head.size() - 5, 5, "Error") == 0 ||
                                (head.size() >= 9 &&
                                 head.compare(head.size() - 9, 9, "Exception") == 0));
}

static std::string trim(const std::string &s)
{
    size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t\r");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

/* The short form of a libtorch message: see above. */
static std::string torch_summary(const std::string &full)
{
    std::vector<std::string> lines;
    size_t pos = 0;
    while (pos <= full.size()) {
        size_t nl = full.find('\n', pos);
        if (nl == std::string::npos)
            nl = full.size();
        lines.push_back(full.substr(pos, nl - pos));
        pos = nl + 1;
    }
    std::string first = trim(lines.empty() ? std::string() : lines[0]);
    if (first.rfind("The following operation failed in the TorchScript interpreter", 0) != 0)
        return first.empty() ? std::string("unknown error") : first;
    /* the reason: the last "XxxError: ..." line, with what follows it */
    std::string reason, op;
    for (size_t i = lines.size(); i-- > 1;) {
        if (is_reason_line(lines[i])) {
            reason = trim(lines[i]);
            for (size_t j = i + 1; j < lines.size() && reason.size() < 300; j++)
                if (!trim(lines[j]).empty())
                    reason += " " + trim(lines[j]);
            break;
        }
    }
    /* the operation: the code line above the last "<--- HERE" marker of the
     * serialized-code traceback (the innermost call that raised) */
    size_t orig = lines.size();
    for (size_t i = 0; i < lines.size(); i++)
        if (lines[i].rfind("Traceback of TorchScript, original code", 0) == 0) {
            orig = i;
            break;
        }
    for (size_t i = orig; i-- > 1;)
        if (lines[i].find("<--- HERE") != std::string::npos) {
            op = trim(lines[i - 1]);
            if (op.rfind("return ", 0) == 0)
                op = op.substr(7);
            break;
        }
    if (reason.empty())
        reason = "the TorchScript interpreter raised an error (the server log has libtorch's "
                 "whole message)";
    if (!op.empty())
        reason += " (in " + op + ")";
    return reason;
}

static std::string one_line(const std::string &s)
{
    std::string o;
    o.reserve(s.size());
    for (char c : s) {
        if (c == '\n')
            o += "\\n";
        else if ((unsigned char)c < 0x20 || c == 0x7f)
            o += ' ';
        else
            o += c;
    }
    return o;
}

/* `err` gets libtorch's reason in one line; its whole message (the
 * TorchScript traceback) is logged when it says more, unless `quiet`. */
static void set_torch_err_logged(md_err *err, md_status st, const char *what, const char *msg,
                                 bool quiet)
{
    std::string full(msg ? msg : "unknown error");
    std::string s = torch_summary(full);
    if (!quiet && s != trim(full))
        md_log(MD_LOG_WARN, "%s: libtorch said: %s", what, one_line(full).c_str());
    md_err_set(err, st, "%s: %s", what, s.c_str());
}

static void set_torch_err(md_err *err, md_status st, const char *what, const char *msg)
{
    set_torch_err_logged(err, st, what, msg, false);
}

/* what() of a c10::Error has a C++ backtrace; what_without_backtrace has not */
static const char *error_text(const std::exception &e)
{
    const c10::Error *ce = dynamic_cast<const c10::Error *>(&e);
    return ce ? ce->what_without_backtrace() : e.what();
}

extern "C" const char *md_torch_version(void) { return TORCH_VERSION; }

extern "C" int md_torch_built_with_cuda(void)
{
#ifdef WITH_CUDA
    return 1;
#else
    return 0;
#endif
}

extern "C" int md_torch_cuda_device_count(void)
{
    try {
        return torch::cuda::is_available() ? (int)torch::cuda::device_count() : 0;
    } catch (...) {
        return 0;
    }
}

extern "C" void md_torch_init(int intra_op_threads)
{
    try {
        /* OpenBLAS reads OPENBLAS_NUM_THREADS when it loads, before main;
         * set it through its API so one worker is one core. */
        typedef void (*set_threads_fn)(int);
        set_threads_fn set = (set_threads_fn)dlsym(RTLD_DEFAULT, "openblas_set_num_threads");
        if (set)
            set(1);
        at::set_num_threads(intra_op_threads > 0 ? intra_op_threads : 1);
        at::set_num_interop_threads(1);
    } catch (...) {
        /* set_num_interop_threads throws if called twice; harmless */
    }
}

/* A zip that torch.jit.load refuses may be what torch.save writes (a
 * state_dict or a pickled module: data.pkl, no constants.pkl or code/):
 * then say what the file is and how to make a TorchScript archive of it. */
static bool is_torch_save_zip(const char *path)
{
    try {
        caffe2::serialize::PyTorchStreamReader reader(path);
        return reader.hasRecord("data.pkl") && !reader.hasRecord("constants.pkl");
    } catch (...) {
        return false;
    }
}

extern "C" md_status md_torch_load(const char *path, const char *device, md_dtype input_dtype,
                                   md_torch_model **out, md_err *err)
{
    *out = nullptr;
    try {
        std::string dev = device && *device ? device : "cpu";
        int cuda_n = md_torch_cuda_device_count();
        if (dev == "auto")
            dev = cuda_n > 0 ? "cuda:0" : "cpu";
        if (dev.rfind("cuda", 0) == 0) {
            if (!md_torch_built_with_cuda())
                return md_err_setc(err, MD_EUNPROC, "cuda_unavailable",
                                   "device \"%s\" needs CUDA, but this modeld was built without "
                                   "it; use \"cpu\" or \"auto\", or run the CUDA image "
                                   "(docker/Dockerfile.cuda)",
                                   dev.c_str());
            if (cuda_n == 0)
                return md_err_setc(err, MD_EUNPROC, "cuda_unavailable",
                                   "device \"%s\" was asked for but no CUDA device is visible; "
                                   "use \"cpu\" or \"auto\"",
                                   dev.c_str());
            if (dev == "cuda")
                dev = "cuda:0";
            int index = atoi(dev.c_str() + 5);
            if (index >= cuda_n)
                return md_err_setc(err, MD_EUNPROC, "cuda_unavailable",
                                   "device \"%s\" does not exist; %d CUDA device(s) visible",
                                   dev.c_str(), cuda_n);
        }
        torch::Device d(dev);
        torch::jit::script::Module module = torch::jit::load(path, d);
        module.eval();
        md_torch_model *m = new (std::nothrow) md_torch_model{std::move(module), d,
                                                              scalar_type(input_dtype), dev};
        if (!m)
            return md_err_set(err, MD_ENOMEM, "out of memory loading the model");
        *out = m;
        return MD_OK;
    } catch (const c10::OutOfMemoryError &e) {
        /* memory (a GPU's too) runs short for a while: not the checkpoint's
         * fault, so not remembered as a bad version */
        set_torch_err(err, MD_ENOMEM, "out of memory loading the model", error_text(e));
        return MD_ENOMEM;
    } catch (const std::bad_alloc &) {
        return md_err_set(err, MD_ENOMEM, "out of memory loading the model; retry later");
    } catch (const std::exception &e) {
        if (is_torch_save_zip(path))
            return md_err_setc(err, MD_EUNPROC, "not_torchscript",
                               "the checkpoint is a torch.save() file (a state_dict or a pickled "
                               "model), not a TorchScript archive; export the trained model with "
                               "torch.jit.script(model).save(\"model.pt\") (or torch.jit.trace) "
                               "and upload that file");
        set_torch_err(err, MD_EUNPROC, "libtorch could not load the checkpoint", error_text(e));
        return MD_EUNPROC;
    } catch (...) {
        return md_err_set(err, MD_EUNPROC, "libtorch could not load the checkpoint");
    }
}

extern "C" const char *md_torch_device(const md_torch_model *m) { return m->device_name.c_str(); }

static thread_local bool thread_background = false;

extern "C" void md_torch_set_thread_background(int background)
{
    thread_background = background != 0;
}

#ifdef WITH_CUDA
/* A worker thread's stream, lent from a process-wide list and given back
 * when the thread ends, so the workers of a version loaded again reuse the
 * streams of the last one. cuBLAS keeps a workspace per (handle, stream)
 * that nothing frees; taking a fresh pool stream in every new thread grew the
 * process by about one workspace per load (30-70 MiB on an H100) until the
 * pool's streams were all used, near 1 GiB. The list is never destroyed: a
 * thread may end after static destructors ran. */
struct idle_stream {
    c10::cuda::CUDAStream stream;
    bool high;
};
static std::mutex *idle_streams_mu = new std::mutex;
static std::vector<idle_stream> *idle_streams = new std::vector<idle_stream>;

struct lent_stream {
    c10::optional<c10::cuda::CUDAStream> stream;
    bool high = false;
    ~lent_stream() { give_back(); }
    void give_back()
    {
        if (!stream)
            return;
        std::lock_guard<std::mutex> lock(*idle_streams_mu);
        idle_streams->push_back({*stream, high});
        stream.reset();
    }
    c10::cuda::CUDAStream get(bool want_high, c10::DeviceIndex device)
    {
        if (stream && stream->device_index() == device && high == want_high)
            return *stream;
        give_back();
        {
            std::lock_guard<std::mutex> lock(*idle_streams_mu);
            for (size_t i = idle_streams->size(); i-- > 0;) {
                idle_stream &e = (*idle_streams)[i];
                if (e.high == want_high && e.stream.device_index() == device) {
                    stream = e.stream;
                    idle_streams->erase(idle_streams->begin() + (long)i);
                    break;
                }
            }
        }
        if (!stream)
            stream = c10::cuda::getStreamFromPool(want_high, device);
        high = want_high;
        return *stream;
    }
};
static thread_local lent_stream thread_stream;
#endif

static md_status forward(md_torch_model *m, const float *input, const int64_t *shape, int ndim,
                         float **out, int64_t *out_shape, int *out_ndim, bool quiet, md_err *err)
{
    *out = nullptr;
    try {
        c10::InferenceMode guard;
        std::vector<int64_t> sizes(shape, shape + ndim);
        /* from_blob does not copy; the cast or the device move below does
         * when needed, and the input outlives the forward. */
        torch::Tensor x = torch::from_blob(const_cast<float *>(input), sizes, torch::kFloat32);
#ifdef WITH_CUDA
        /* each worker thread gets its own stream, so copies and kernels of
         * different workers overlap; online workers' streams are
         * high-priority, job workers' low-priority */
        c10::optional<c10::cuda::CUDAStreamGuard> stream_guard;
        if (m->device.is_cuda())
            stream_guard.emplace(thread_stream.get(!thread_background, m->device.index()));
#endif
        if (m->device.is_cuda())
            x = x.pin_memory().to(m->device, m->dtype, /*non_blocking=*/true);
        else if (m->dtype != torch::kFloat32)
            x = x.to(m->dtype);
        std::vector<torch::jit::IValue> args{x};
        torch::jit::IValue r = m->module.forward(args);
        torch::Tensor y;
        if (r.isTensor())
            y = r.toTensor();
        else if (r.isTuple() && !r.toTuple()->elements().empty() &&
                 r.toTuple()->elements()[0].isTensor())
            y = r.toTuple()->elements()[0].toTensor();
        else if (r.isList() && r.toList().size() > 0 && r.toList().get(0).isTensor())
            y = r.toList().get(0).toTensor();
        else
            return md_err_setc(err, MD_EUNPROC, "bad_model_output",
                               "the model's forward returned %s, not a tensor",
                               r.tagKind().c_str());
        y = y.to(torch::kCPU, torch::kFloat32).contiguous();
        if (y.dim() > 8 || y.dim() < 1)
            return md_err_setc(err, MD_EUNPROC, "bad_model_output",
                               "the model's output has %d dimensions; 1 to 8 are supported",
                               (int)y.dim());
        size_t n = (size_t)y.numel();
        float *buf = (float *)malloc(n ? n * sizeof(float) : 1);
        if (!buf)
            return md_err_set(err, MD_ENOMEM, "out of memory for the model's output");
        memcpy(buf, y.data_ptr<float>(), n * sizeof(float));
        *out_ndim = (int)y.dim();
        for (int i = 0; i < y.dim(); i++)
            out_shape[i] = y.size(i);
        *out = buf;
        return MD_OK;
    } catch (const c10::OutOfMemoryError &e) {
        set_torch_err_logged(err, MD_ENOMEM, "out of memory in the model's forward", error_text(e),
                             quiet);
        return MD_ENOMEM;
    } catch (const std::bad_alloc &) {
        return md_err_set(err, MD_ENOMEM, "out of memory in the model's forward; retry later");
    } catch (const std::exception &e) {
        set_torch_err_logged(err, MD_EUNPROC, "the model's forward failed", error_text(e), quiet);
        return MD_EUNPROC;
    } catch (...) {
        return md_err_set(err, MD_EUNPROC, "the model's forward failed");
    }
}

extern "C" md_status md_torch_forward(md_torch_model *m, const float *input, const int64_t *shape,
                                      int ndim, float **out, int64_t *out_shape, int *out_ndim,
                                      md_err *err)
{
    return forward(m, input, shape, ndim, out, out_shape, out_ndim, false, err);
}

extern "C" md_status md_torch_forward_quiet(md_torch_model *m, const float *input,
                                            const int64_t *shape, int ndim, float **out,
                                            int64_t *out_shape, int *out_ndim, md_err *err)
{
    return forward(m, input, shape, ndim, out, out_shape, out_ndim, true, err);
}

static const char *dtype_name(torch::ScalarType t)
{
    switch (t) {
    case torch::kFloat32: return "float32";
    case torch::kFloat64: return "float64";
    case torch::kFloat16: return "float16";
    case torch::kBFloat16: return "bfloat16";
    case torch::kInt64: return "int64";
    case torch::kInt32: return "int32";
    case torch::kInt16: return "int16";
    case torch::kInt8: return "int8";
    case torch::kUInt8: return "uint8";
    case torch::kBool: return "bool";
    default: return "other";
    }
}

/* One input of md_torch_forward_io as a tensor on the model's device. The
 * rows are copied into a tensor of their own (the words of several inputs
 * interleave row by row, and an int64 may sit at a 4-byte offset). */
static torch::Tensor io_input(const md_torch_model *m, const md_torch_in *in)
{
    std::vector<int64_t> sizes(in->shape, in->shape + in->ndim);
    int64_t rows = in->shape[0], values = 1;
    for (int d = 1; d < in->ndim; d++)
        values *= in->shape[d];
    torch::Tensor x = torch::empty(sizes, in->is_int ? torch::kInt64 : torch::kFloat32);
    size_t row_bytes = (size_t)values * (in->is_int ? 8 : 4);
    char *dst = (char *)x.data_ptr();
    const float *src = in->base;
    for (int64_t r = 0; r < rows; r++, src += in->row_words, dst += row_bytes)
        memcpy(dst, src, row_bytes);
    torch::ScalarType want = scalar_type(in->dtype);
    if (m->device.is_cuda())
        return x.pin_memory().to(m->device, want, /*non_blocking=*/true);
    return want == x.scalar_type() ? x : x.to(want);
}

extern "C" md_status md_torch_forward_io(md_torch_model *m, const md_torch_in *in, int n_in,
                                         const char *const *keys, int n_out, int quiet,
                                         md_torch_outs *out, md_err *err)
{
    memset(out, 0, sizeof *out);
    if (n_out < 1 || n_out > MD_MAX_IO || n_in < 1 || n_in > MD_MAX_IO)
        return md_err_set(err, MD_EINVAL, "1 to %d inputs and outputs", MD_MAX_IO);
    try {
        c10::InferenceMode guard;
#ifdef WITH_CUDA
        c10::optional<c10::cuda::CUDAStreamGuard> stream_guard;
        if (m->device.is_cuda())
            stream_guard.emplace(thread_stream.get(!thread_background, m->device.index()));
#endif
        std::vector<torch::jit::IValue> args;
        args.reserve((size_t)n_in);
        for (int i = 0; i < n_in; i++)
            args.emplace_back(io_input(m, &in[i]));
        int64_t rows = in[0].shape[0];
        torch::jit::IValue r = m->module.forward(args);
        std::vector<torch::Tensor> ys((size_t)n_out);
        for (int j = 0; j < n_out; j++) {
            torch::jit::IValue v;
            if (r.isGenericDict()) {
                c10::impl::GenericDict d = r.toGenericDict();
                auto it = d.find(c10::IValue(std::string(keys[j])));
                if (it == d.end()) {
                    std::string have;
                    for (auto &e : d)
                        if (e.key().isString())
                            have += (have.empty() ? "" : ", ") + e.key().toStringRef();
                    return md_err_setc(err, MD_EUNPROC, "bad_model_output",
                                       "the model's forward returned a dict without the key "
                                       "\"%s\" (it has: %s); name config.outputs after its keys",
                                       keys[j], have.c_str());
                }
                v = it->value();
            } else if (r.isTuple() || r.isList()) {
                std::vector<c10::IValue> el;
                if (r.isTuple())
                    el = r.toTuple()->elements().vec();
                else
                    el = r.toList().vec();
                if ((size_t)j >= el.size())
                    return md_err_setc(err, MD_EUNPROC, "bad_model_output",
                                       "the model's forward returned %zu values, so there is "
                                       "none for output \"%s\" (number %d of config.outputs)",
                                       el.size(), keys[j], j + 1);
                v = el[(size_t)j];
            } else if (n_out == 1) {
                v = r;
            } else {
                std::string kind = r.tagKind();
                return md_err_setc(err, MD_EUNPROC, "bad_model_output",
                                   "the model's forward returned one %s, not the %d outputs "
                                   "config.outputs declares",
                                   kind.c_str(), n_out);
            }
            if (!v.isTensor()) {
                std::string kind = v.tagKind();
                return md_err_setc(err, MD_EUNPROC, "bad_model_output",
                                   "output \"%s\" of the model's forward is a %s, not a tensor",
                                   keys[j], kind.c_str());
            }
            torch::Tensor y = v.toTensor();
            snprintf(out->dtype[j], sizeof out->dtype[j], "%s", dtype_name(y.scalar_type()));
            if (y.dim() < 1 || y.dim() > 8 || y.size(0) != rows)
                return md_err_setc(err, MD_EUNPROC, "bad_model_output",
                                   "output \"%s\" has %lld rows for a batch of %lld; every "
                                   "output must keep the batch dimension",
                                   keys[j], y.dim() < 1 ? 0LL : (long long)y.size(0),
                                   (long long)rows);
            ys[(size_t)j] = y.to(torch::kCPU, torch::kFloat32).contiguous().view({rows, -1});
            out->ndim[j] = (int)y.dim();
            for (int d = 0; d < y.dim(); d++)
                out->shape[j][d] = y.size(d);
            out->values[j] = ys[(size_t)j].size(1);
            out->off[j] = out->row_values;
            out->row_values += out->values[j];
        }
        /* everything that can throw first: the outputs side by side in a
         * tensor, then the one malloc'd copy the caller owns */
        std::vector<torch::Tensor> parts(ys.begin(), ys.end());
        torch::Tensor packed = torch::cat(parts, 1).contiguous();
        const float *src = packed.data_ptr<float>();
        size_t n = (size_t)rows * (size_t)out->row_values;
        float *buf = (float *)malloc(n ? n * sizeof(float) : 1);
        if (!buf)
            return md_err_set(err, MD_ENOMEM, "out of memory for the model's output");
        memcpy(buf, src, n * sizeof(float));
        out->n = n_out;
        out->data = buf;
        return MD_OK;
    } catch (const c10::OutOfMemoryError &e) {
        set_torch_err_logged(err, MD_ENOMEM, "out of memory in the model's forward", error_text(e),
                             quiet);
        return MD_ENOMEM;
    } catch (const std::bad_alloc &) {
        return md_err_set(err, MD_ENOMEM, "out of memory in the model's forward; retry later");
    } catch (const std::exception &e) {
        set_torch_err_logged(err, MD_EUNPROC, "the model's forward failed", error_text(e), quiet);
        return MD_EUNPROC;
    } catch (...) {
        return md_err_set(err, MD_EUNPROC, "the model's forward failed");
    }
}

extern "C" void md_torch_free(md_torch_model *m)
{
#ifdef WITH_CUDA
    bool on_cuda = m && m->device.is_cuda();
#endif
    delete m;
#ifdef WITH_CUDA
    /* the caching allocator keeps what the version's weights and forwards
     * freed for reuse: an unloaded version's GPU memory would stay taken
     * (nvidia-smi) for this process only. Give back the unused blocks; the
     * other versions' blocks in use stay (issue 24). */
    if (on_cuda) {
        try {
            c10::cuda::CUDACachingAllocator::emptyCache();
        } catch (const std::exception &) {
            /* nothing to give back is not an error worth more than that */
        }
    }
#endif
}

extern "C" md_status md_torch_resident_bytes(const md_torch_model *m, size_t *out, md_err *err)
{
    *out = 0;
    try {
        /* tied weights (an embedding shared with the output layer) and views
         * share one storage: count each storage once, whole */
        std::unordered_set<const void *> seen;
        size_t total = 0;
        auto add = [&](const at::Tensor &t) {
            if (!t.defined() || !t.has_storage())
                return; /* mkldnn or sparse: no plain storage to count */
            const c10::Storage &s = t.storage();
            if (seen.insert(s.unsafeGetStorageImpl()).second)
                total += s.nbytes();
        };
        for (const at::Tensor &p : m->module.parameters(true))
            add(p);
        for (const at::Tensor &b : m->module.buffers(true))
            add(b);
        *out = total;
        return MD_OK;
    } catch (const std::exception &e) {
        set_torch_err(err, MD_EINTERNAL, "could not size the model's parameters", error_text(e));
        return MD_EINTERNAL;
    } catch (...) {
        return md_err_set(err, MD_EINTERNAL, "could not size the model's parameters");
    }
}

/* ---- per-worker replicas with prepacked linear layers ---- */

/* aten::linear -> XNNPACK's prepacked linear, for linears whose weight is a
 * float32 CPU constant of the frozen graph (and bias a constant or None):
 * OpenBLAS's sgemm packs the whole weight matrix on every call, which at
 * batches of 1 to 16 rows costs more than the arithmetic (measured on the
 * FashionMNIST MLP: 197 -> 58 us a forward at batch 1, 315 -> 126 at 8,
 * 664 -> 598 at 64 on one thread). A weight computed in forward is left to
 * aten::linear: packing it on every call would be slower. */
static bool constant_f32_matrix(torch::jit::Value *v, size_t *bytes, int64_t *width)
{
    if (v->node()->kind() != c10::prim::Constant)
        return false;
    c10::optional<c10::IValue> iv = torch::jit::toIValue(v);
    if (!iv || !iv->isTensor())
        return false;
    const torch::Tensor &t = iv->toTensor();
    if (t.dim() != 2 || t.scalar_type() != torch::kFloat32 || !t.device().is_cpu() ||
        t.size(0) == 0 || t.size(1) == 0)
        return false;
    *bytes += (size_t)t.numel() * sizeof(float);
    *width = t.size(1);
    return true;
}

static bool constant_f32_bias(torch::jit::Value *v)
{
    if (v->node()->kind() != c10::prim::Constant)
        return false;
    if (v->type()->kind() == c10::TypeKind::NoneType)
        return true;
    c10::optional<c10::IValue> iv = torch::jit::toIValue(v);
    if (!iv || iv->isNone())
        return true;
    if (!iv->isTensor())
        return false;
    const torch::Tensor &t = iv->toTensor();
    return t.dim() == 1 && t.scalar_type() == torch::kFloat32 && t.device().is_cpu();
}

/* Whether `n` is a linear this file packs; adds its weight bytes and width. */
static bool packable(torch::jit::Node *n, size_t *bytes, int64_t *width)
{
    return n->kind() == c10::aten::linear && n->inputs().size() == 3 &&
           constant_f32_matrix(n->input(1), bytes, width) && constant_f32_bias(n->input(2));
}

/*
 * Replace the linear node `n` in place: the new nodes go exactly where it
 * was, so an in-place write to its input before it (x[:, 0] = 42) or after
 * it keeps its order (a pattern rewriter would put them after the input's
 * definition, before such a write: seen in review). They are
 *   parts = aten::split_with_sizes(x, [width], -1); x2 = prim::ListUnpack(parts)
 *   ctx = prepacked::linear_clamp_prepack(w, b, None, None)
 *   y = prepacked::linear_clamp_run(x2, ctx)
 * XNNPACK's linear (libtorch 1.13) never compares the input's last dimension
 * with the weight's, and reads a narrower row past its end:
 * split_with_sizes([width]) is an exact check (its sizes must sum to that
 * dimension) that returns a view. A mismatch fails the forward, and the
 * worker answers with the module's own reason (the fallback in batcher.c).
 */
static void pack_linear(torch::jit::Graph &g, torch::jit::Node *n, int64_t width)
{
    torch::jit::WithInsertPoint at(n);
    torch::jit::Value *x = n->input(0), *w = n->input(1), *b = n->input(2);
    torch::jit::Value *parts = g.insert(
        c10::aten::split_with_sizes,
        {torch::jit::NamedValue(x), torch::jit::NamedValue(c10::IValue(std::vector<int64_t>{width})),
         torch::jit::NamedValue(c10::IValue((int64_t)-1))});
    torch::jit::Value *x2 = g.insertNode(g.createListUnpack(parts, 1))->output();
    torch::jit::Value *none = g.insertConstant(c10::IValue());
    torch::jit::Value *ctx =
        g.insert(c10::Symbol::fromQualString("prepacked::linear_clamp_prepack"),
                 {torch::jit::NamedValue(w), torch::jit::NamedValue(b),
                  torch::jit::NamedValue(none), torch::jit::NamedValue(none)});
    torch::jit::Value *y =
        g.insert(c10::Symbol::fromQualString("prepacked::linear_clamp_run"),
                 {torch::jit::NamedValue(x2), torch::jit::NamedValue(ctx)});
    n->output()->replaceAllUsesWith(y);
    n->destroy();
}

extern "C" md_status md_torch_replica(const md_torch_model *base, size_t max_weight_bytes,
                                      md_torch_model **out, size_t *packed_bytes, md_err *err)
{
    *out = nullptr;
    *packed_bytes = 0;
    if (!base->device.is_cpu())
        return MD_OK;
    /* one replica at a time per model: a clone registers its types in the
     * model's own compilation unit (each torch::jit::load makes its own),
     * which is not safe to change from two threads at once */
    std::lock_guard<std::mutex> lock(base->replica_mu);
    if (base->replica_verdict < 0) { /* a worker found nothing to pack, or too much */
        *packed_bytes = base->verdict_bytes;
        return MD_OK;
    }
    try {
        torch::NoGradGuard no_grad;
        /* freeze: attributes become graph constants; optimize_numerics off
         * keeps the graph's arithmetic as written (no conv-bn folding) */
        torch::jit::Module frozen = torch::jit::freeze(base->module, c10::nullopt, false);
        std::shared_ptr<torch::jit::Graph> graph = frozen.get_method("forward").graph();
        /* the top-level block only: a linear inside an If or a Loop runs as
         * written (counted and packed by the same walk) */
        std::vector<std::pair<torch::jit::Node *, int64_t>> todo;
        size_t bytes = 0;
        for (torch::jit::Node *n : graph->nodes()) {
            int64_t width = 0;
            if (packable(n, &bytes, &width))
                todo.emplace_back(n, width);
        }
        *packed_bytes = bytes;
        if (todo.empty() || bytes > max_weight_bytes) {
            base->replica_verdict = -1;
            base->verdict_bytes = bytes;
            return MD_OK;
        }
        for (auto &t : todo)
            pack_linear(*graph, t.first, t.second);
        /* a ReLU or hardtanh right after a linear becomes its output clamp,
         * then the packing runs once, here, and its result is a constant */
        torch::jit::fusePrePackedLinearConvWithClamp(frozen);
        torch::jit::FoldPrePackingOps(frozen);
        md_torch_model *m = new (std::nothrow) md_torch_model{std::move(frozen), base->device,
                                                              base->dtype, base->device_name};
        if (!m)
            return md_err_set(err, MD_ENOMEM, "out of memory for a worker's copy of the model");
        *out = m;
        return MD_OK;
    } catch (const std::bad_alloc &) {
        return md_err_set(err, MD_ENOMEM, "out of memory for a worker's copy of the model");
    } catch (const std::exception &e) {
        base->replica_verdict = -1; /* the same for every worker: try once */
        set_torch_err(err, MD_EUNPROC, "the model's linear layers could not be prepacked",
                      error_text(e));
        return MD_EUNPROC;
    } catch (...) {
        base->replica_verdict = -1;
        return md_err_set(err, MD_EUNPROC, "the model's linear layers could not be prepacked");
    }
}

/* ---- training checkpoints (issue 12): zip records, architectures ---- */

#include <map>
#include <memory>

struct md_torch_zip {
    std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
    std::map<std::string, std::pair<at::DataPtr, size_t>> records;
};

extern "C" md_status md_torch_zip_open(const char *path, md_torch_zip **out, md_err *err)
{
    *out = nullptr;
    try {
        auto reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
        md_torch_zip *z = new (std::nothrow) md_torch_zip;
        if (!z)
            return md_err_set(err, MD_ENOMEM, "out of memory opening a zip archive");
        z->reader = std::move(reader);
        *out = z;
        return MD_OK;
    } catch (const std::exception &e) {
        set_torch_err(err, MD_EUNPROC, "the file is not a readable zip archive", error_text(e));
        return MD_EUNPROC;
    } catch (...) {
        return md_err_set(err, MD_EUNPROC, "the file is not a readable zip archive");
    }
}

extern "C" int md_torch_zip_has_record(md_torch_zip *z, const char *name)
{
    try {
        return z->reader->hasRecord(name) ? 1 : 0;
    } catch (...) {
        return 0;
    }
}

extern "C" md_status md_torch_zip_record(md_torch_zip *z, const char *name, const uint8_t **data,
                                         size_t *size, md_err *err)
{
    *data = nullptr;
    *size = 0;
    try {
        auto it = z->records.find(name);
        if (it == z->records.end()) {
            if (!z->reader->hasRecord(name))
                return md_err_set(err, MD_ENOTFOUND, "the archive has no record \"%.200s\"",
                                  name);
            auto rec = z->reader->getRecord(name);
            it = z->records.emplace(name, std::make_pair(std::move(std::get<0>(rec)),
                                                         std::get<1>(rec))).first;
        }
        *data = static_cast<const uint8_t *>(it->second.first.get());
        *size = it->second.second;
        return MD_OK;
    } catch (const std::bad_alloc &) {
        return md_err_set(err, MD_ENOMEM, "out of memory reading record \"%.200s\"", name);
    } catch (const std::exception &e) {
        set_torch_err(err, MD_EUNPROC, "a zip record could not be read", error_text(e));
        return MD_EUNPROC;
    } catch (...) {
        return md_err_set(err, MD_EUNPROC, "zip record \"%.200s\" could not be read", name);
    }
}

extern "C" void md_torch_zip_close(md_torch_zip *z) { delete z; }

static bool ckpt_scalar_type(md_ckpt_dtype d, torch::ScalarType *out)
{
    switch (d) {
    case MD_CKPT_F32: *out = torch::kFloat32; return true;
    case MD_CKPT_F16: *out = torch::kFloat16; return true;
    case MD_CKPT_BF16: *out = torch::kBFloat16; return true;
    case MD_CKPT_F64: *out = torch::kFloat64; return true;
    case MD_CKPT_I64: *out = torch::kInt64; return true;
    case MD_CKPT_I32: *out = torch::kInt32; return true;
    case MD_CKPT_I16: *out = torch::kInt16; return true;
    case MD_CKPT_I8: *out = torch::kInt8; return true;
    case MD_CKPT_U8: *out = torch::kUInt8; return true;
    case MD_CKPT_BOOL: *out = torch::kBool; return true;
    default: return false;
    }
}

static bool ckpt_dtype_of(torch::ScalarType t, md_ckpt_dtype *out)
{
    for (int d = 0; d < MD_CKPT_DTYPE_COUNT; d++) {
        torch::ScalarType s;
        if (ckpt_scalar_type((md_ckpt_dtype)d, &s) && s == t) {
            *out = (md_ckpt_dtype)d;
            return true;
        }
    }
    return false;
}

/* A module's parameters and buffers by dotted name, in state_dict order: each
 * module's own parameters, then its own buffers, then its children's. */
struct named_slot {
    std::string name;
    torch::Tensor tensor;
    bool is_buffer;
};

static std::vector<named_slot> state_slots(const torch::jit::script::Module &root)
{
    std::vector<named_slot> slots;
    for (const auto &m : root.named_modules()) {
        std::string prefix = m.name.empty() ? "" : m.name + ".";
        for (const auto &p : m.value.named_parameters(false))
            slots.push_back({prefix + p.name, p.value, false});
        for (const auto &b : m.value.named_buffers(false))
            slots.push_back({prefix + b.name, b.value, true});
    }
    return slots;
}

static std::string shape_str(c10::IntArrayRef s)
{
    std::string o = "[";
    for (size_t i = 0; i < s.size(); i++)
        o += (i ? "," : "") + std::to_string(s[i]);
    return o + "]";
}

/* "N missing keys (a, b, ...)" with at most `show` names, each shortened. */
static std::string listing(const std::vector<std::string> &items, const char *what, size_t show)
{
    std::string o = std::to_string(items.size()) + " " + what + (items.size() == 1 ? "" : "s") +
                    " (";
    for (size_t i = 0; i < items.size() && i < show; i++)
        o += (i ? ", " : "") + (items[i].size() > 80 ? items[i].substr(0, 77) + "..." : items[i]);
    if (items.size() > show)
        o += ", ...";
    return o + ")";
}

extern "C" md_status md_torch_state_numel(const md_torch_model *m, int64_t *out, md_err *err)
{
    *out = 0;
    try {
        int64_t total = 0;
        for (const named_slot &s : state_slots(m->module))
            if (__builtin_add_overflow(total, (int64_t)s.tensor.numel(), &total))
                return md_err_set(err, MD_EUNPROC, "the architecture's parameters and buffers "
                                  "hold more than 2^63 elements");
        *out = total;
        return MD_OK;
    } catch (const std::exception &e) {
        set_torch_err(err, MD_EUNPROC, "the architecture's parameters could not be listed",
                      error_text(e));
        return MD_EUNPROC;
    } catch (...) {
        return md_err_set(err, MD_EUNPROC, "the architecture's parameters could not be listed");
    }
}

extern "C" md_status md_torch_load_state(const char *arch_path, const char *device,
                                         md_dtype input_dtype,
                                         const md_torch_named_tensor *tensors, size_t count,
                                         md_torch_model **out, md_err *err)
{
    *out = nullptr;
    md_torch_model *m = nullptr;
    md_status st = md_torch_load(arch_path, device, input_dtype, &m, err);
    if (st != MD_OK)
        return st;
    if ((st = md_torch_set_state(m, tensors, count, err)) != MD_OK) {
        md_torch_free(m);
        return st;
    }
    *out = m;
    return MD_OK;
}

extern "C" md_status md_torch_set_state(md_torch_model *m, const md_torch_named_tensor *tensors,
                                        size_t count, md_err *err)
{
    try {
        std::vector<named_slot> slots = state_slots(m->module);
        std::map<std::string, size_t> by_name;
        for (size_t i = 0; i < slots.size(); i++)
            by_name[slots[i].name] = i;
        /* the file's names as-is, or all without "module." if that matches */
        auto name_of = [&](size_t i, bool strip) {
            const char *n = tensors[i].name;
            return std::string(strip ? md_ckpt_strip_module(n) : n);
        };
        /* DDP's "module." prefix: stripped when every name has it and the
         * stripped names match more of the architecture than the raw ones
         * (an architecture may itself have a submodule named "module") */
        bool all_prefixed = count > 0;
        size_t raw_hits = 0, stripped_hits = 0;
        for (size_t i = 0; i < count; i++) {
            all_prefixed = all_prefixed && strncmp(tensors[i].name, "module.", 7) == 0;
            raw_hits += by_name.count(name_of(i, false));
            stripped_hits += by_name.count(name_of(i, true));
        }
        bool strip = all_prefixed && stripped_hits > raw_hits;
        std::vector<std::string> missing, unexpected, mismatched;
        std::vector<long> source(slots.size(), -1);
        for (size_t i = 0; i < count; i++) {
            std::string n = name_of(i, strip);
            auto it = by_name.find(n);
            if (it == by_name.end()) {
                unexpected.push_back(tensors[i].name);
                continue;
            }
            const torch::Tensor &dst = slots[it->second].tensor;
            std::vector<int64_t> shape(tensors[i].shape, tensors[i].shape + tensors[i].ndim);
            bool src_float = md_ckpt_dtype_is_float(tensors[i].dtype) != 0;
            if (dst.sizes() != c10::IntArrayRef(shape))
                mismatched.push_back(n + ": checkpoint " + shape_str(shape) + ", architecture " +
                                     shape_str(dst.sizes()));
            else if (src_float != dst.is_floating_point())
                mismatched.push_back(n + ": checkpoint " + md_ckpt_dtype_name(tensors[i].dtype) +
                                     ", architecture " + c10::toString(dst.scalar_type()));
            source[it->second] = (long)i;
        }
        for (size_t s = 0; s < slots.size(); s++)
            if (source[s] < 0)
                missing.push_back(slots[s].name);
        if (!missing.empty() || !unexpected.empty() || !mismatched.empty()) {
            std::string msg = "the checkpoint does not match the architecture (strict loading):";
            const char *sep = " ";
            if (!missing.empty()) {
                msg += sep + listing(missing, "missing key", 4);
                sep = "; ";
            }
            if (!unexpected.empty()) {
                msg += sep + listing(unexpected, "unexpected key", 4);
                sep = "; ";
            }
            if (!mismatched.empty())
                msg += sep + listing(mismatched, "mismatched tensor", 3);
            return md_err_setc(err, MD_EUNPROC, "state_dict_mismatch", "%s", msg.c_str());
        }
        torch::NoGradGuard no_grad;
        for (size_t s = 0; s < slots.size(); s++) {
            const md_torch_named_tensor &src = tensors[source[s]];
            torch::ScalarType type;
            if (!ckpt_scalar_type(src.dtype, &type)) {
                return md_err_set(err, MD_EINVAL, "tensor \"%.200s\" has an unknown dtype",
                                  src.name);
            }
            std::vector<int64_t> shape(src.shape, src.shape + src.ndim);
            torch::Tensor t = torch::from_blob(const_cast<void *>(src.data), shape, type);
            slots[s].tensor.copy_(t); /* converts dtype, moves to the model's device */
        }
        return MD_OK;
    } catch (const std::exception &e) {
        set_torch_err(err, MD_EUNPROC, "the checkpoint's tensors could not be loaded",
                      error_text(e));
        return MD_EUNPROC;
    } catch (...) {
        return md_err_set(err, MD_EUNPROC, "the checkpoint's tensors could not be loaded");
    }
}

struct md_torch_state {
    std::vector<named_slot> slots; /* contiguous CPU tensors, or meta ones (shapes only) */
    std::vector<md_ckpt_dtype> dtypes;
};

/* The state of the archive at `path` loaded onto `device` (CPU or meta). */
static md_status state_read_on(const char *path, torch::Device device, md_torch_state **out,
                               md_err *err)
{
    torch::jit::script::Module module = torch::jit::load(path, device);
    std::vector<named_slot> slots = state_slots(module);
    std::vector<md_ckpt_dtype> dtypes;
    for (auto &s : slots) {
        md_ckpt_dtype d;
        if (!ckpt_dtype_of(s.tensor.scalar_type(), &d))
            return md_err_set(err, MD_EUNPROC, "%s \"%.200s\" has dtype %s, which checkpoint "
                              "files cannot hold; use float, integer or bool tensors",
                              s.is_buffer ? "buffer" : "parameter", s.name.c_str(),
                              c10::toString(s.tensor.scalar_type()));
        /* the module's own storage where it already is a contiguous CPU
         * tensor (a copy of every tensor would hold the weights twice) */
        s.tensor = s.tensor.detach();
        if (!device.is_meta())
            s.tensor = s.tensor.to(torch::kCPU).contiguous();
        dtypes.push_back(d);
    }
    md_torch_state *st = new (std::nothrow) md_torch_state{std::move(slots), std::move(dtypes)};
    if (!st)
        return md_err_set(err, MD_ENOMEM, "out of memory reading an architecture");
    *out = st;
    return MD_OK;
}

extern "C" md_status md_torch_state_read(const char *path, md_torch_state **out, md_err *err)
{
    *out = nullptr;
    try {
        return state_read_on(path, torch::kCPU, out, err);
    } catch (const std::exception &e) {
        set_torch_err(err, MD_EUNPROC, "libtorch could not load the architecture", error_text(e));
        return MD_EUNPROC;
    } catch (...) {
        return md_err_set(err, MD_EUNPROC, "libtorch could not load the architecture");
    }
}

extern "C" md_status md_torch_state_read_shapes(const char *path, md_torch_state **out,
                                                md_err *err)
{
    *out = nullptr;
    try {
        md_status st = state_read_on(path, torch::Device(torch::kMeta), out, err);
        if (st == MD_OK || st == MD_EUNPROC)
            return st; /* a dtype no file holds is that on any device */
    } catch (...) {
        /* e.g. a __setstate__ that needs real values: read it whole below */
    }
    return md_torch_state_read(path, out, err);
}

extern "C" size_t md_torch_state_count(const md_torch_state *s) { return s->slots.size(); }

extern "C" void md_torch_state_get(const md_torch_state *s, size_t i, md_torch_named_tensor *out,
                                   int *is_buffer)
{
    const named_slot &slot = s->slots[i];
    out->name = slot.name.c_str();
    out->dtype = s->dtypes[i];
    try {
        /* cannot throw: the tensors are defined, contiguous CPU or meta ones */
        out->ndim = (int)slot.tensor.dim();
        out->shape = slot.tensor.sizes().data();
        out->data = slot.tensor.is_meta() ? nullptr : slot.tensor.data_ptr();
    } catch (...) {
        out->ndim = 0;
        out->shape = nullptr;
        out->data = nullptr;
    }
    if (is_buffer)
        *is_buffer = slot.is_buffer ? 1 : 0;
}

extern "C" void md_torch_state_free(md_torch_state *s) { delete s; }

extern "C" md_status md_torch_cast(const void *src, md_ckpt_dtype from, void *dst,
                                   md_ckpt_dtype to, size_t count, md_err *err)
{
    torch::ScalarType a, b;
    if (!ckpt_scalar_type(from, &a) || !ckpt_scalar_type(to, &b))
        return md_err_set(err, MD_EINVAL, "a tensor has an unknown dtype");
    if (count == 0)
        return MD_OK;
    try {
        torch::Tensor in = torch::from_blob(const_cast<void *>(src), {(int64_t)count}, a);
        torch::Tensor out = torch::from_blob(dst, {(int64_t)count}, b);
        out.copy_(in);
        return MD_OK;
    } catch (const std::bad_alloc &) {
        return md_err_set(err, MD_ENOMEM, "out of memory converting a tensor");
    } catch (const std::exception &e) {
        set_torch_err(err, MD_EUNPROC, "a tensor could not be converted", error_text(e));
        return MD_EUNPROC;
    } catch (...) {
        return md_err_set(err, MD_EUNPROC, "a tensor could not be converted");
    }
}
