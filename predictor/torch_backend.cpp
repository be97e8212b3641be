// torch_backend.cpp - libtorch behind the C header torch_backend.h.
#include "torch_backend.h"

#include <torch/script.h>
#include <torch/version.h>

extern "C" const char *md_torch_version(void) { return TORCH_VERSION; }

extern "C" int md_torch_built_with_cuda(void)
{
#ifdef WITH_CUDA
    return 1;
#else
    return 0;
#endif
}
