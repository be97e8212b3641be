/*
 * ckpt_cuda_check.c - on a machine with a GPU and a CUDA libtorch (pip's
 * torch), check that a torch.save state_dict read by the restricted
 * unpickler loads into a TorchScript architecture on "cuda" and forwards to
 * PyTorch's CPU outputs (max abs difference <= 1e-5). Needs only libtorch,
 * not the server's other dependencies; bench/ckpt_cuda_check.sh builds it.
 * Prints PASS/FAIL lines; exits non-zero on a failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../checkpoint/formats.h"
#include "../predictor/torch_backend.h"

static float *read_npy(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    unsigned char h[10];
    if (!f || fread(h, 1, 10, f) != 10)
        return NULL;
    size_t hlen = h[8] | (size_t)h[9] << 8;
    fseek(f, 0, SEEK_END);
    size_t len = (size_t)ftell(f);
    fseek(f, (long)(10 + hlen), SEEK_SET);
    *n = (len - 10 - hlen) / 4;
    float *out = malloc(*n * 4);
    if (fread(out, 4, *n, f) != *n)
        *n = 0;
    fclose(f);
    return out;
}

static int check(const char *ckpt, const char *arch, const char *input, const int64_t *shape,
                 int ndim, const char *expected, const char *device)
{
    md_err err;
    md_tensors *t = NULL;
    if (md_ckpt_read_torch_zip(ckpt, NULL, &t, &err) != MD_OK) {
        printf("FAIL read %s: %s\n", ckpt, err.msg);
        return 1;
    }
    size_t n = md_tensors_count(t);
    md_torch_named_tensor *v = calloc(n, sizeof *v);
    for (size_t i = 0; i < n; i++)
        v[i] = (md_torch_named_tensor){md_tensors_name(t, i), md_tensors_dtype(t, i),
                                       md_tensors_ndim(t, i), md_tensors_shape(t, i),
                                       md_tensors_data(t, i)};
    md_torch_model *m = NULL;
    md_status st = md_torch_load_state(arch, device, MD_F32, v, n, &m, &err);
    free(v);
    md_tensors_free(t);
    if (st != MD_OK) {
        printf("FAIL load %s into %s on %s: %s\n", ckpt, arch, device, err.msg);
        return 1;
    }
    size_t nin, nwant;
    float *x = read_npy(input, &nin), *want = read_npy(expected, &nwant), *y = NULL;
    int64_t oshape[8];
    int ondim;
    if (md_torch_forward(m, x, shape, ndim, &y, oshape, &ondim, &err) != MD_OK) {
        printf("FAIL forward %s on %s: %s\n", ckpt, device, err.msg);
        return 1;
    }
    double worst = 0;
    for (size_t i = 0; i < nwant; i++)
        worst = fmax(worst, fabs((double)y[i] - want[i]));
    int bad = worst > 1e-5;
    printf("%s %s on %s (%s): max abs difference from PyTorch %.3g\n", bad ? "FAIL" : "PASS",
           ckpt, md_torch_device(m), arch, worst);
    free(x);
    free(want);
    free(y);
    md_torch_free(m);
    return bad;
}

int main(int argc, char **argv)
{
    const char *device = argc > 1 ? argv[1] : "cuda";
    md_torch_init(1);
    printf("libtorch %s, CUDA devices: %d\n", md_torch_version(), md_torch_cuda_device_count());
    static const int64_t mlp[] = {5, 4}, cnn[] = {3, 1, 8, 8};
    int fail = 0;
    static const char *const files[] = {"mlp_sd.pt", "mlp_epoch3.pt", "mlp_sd_module.pt",
                                        "mlp_sd_f64.pt", "mlp_sd_views.pt"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char p[128];
        snprintf(p, sizeof p, "tests/fixtures/ckpt/%s", files[i]);
        fail |= check(p, "tests/fixtures/ckpt/mlp_arch.pt", "tests/fixtures/mlp_input.npy", mlp,
                      2, "tests/fixtures/mlp_expected.npy", device);
    }
    fail |= check("tests/fixtures/ckpt/mlp_sd_f16.pt", "tests/fixtures/ckpt/mlp_arch.pt",
                  "tests/fixtures/mlp_input.npy", mlp, 2,
                  "tests/fixtures/ckpt/mlp_f16_expected.npy", device);
    fail |= check("tests/fixtures/ckpt/bn_sd.pt", "tests/fixtures/ckpt/bn_arch.pt",
                  "tests/fixtures/cnn_input.npy", cnn, 4, "tests/fixtures/ckpt/bn_expected.npy",
                  device);
    return fail;
}
