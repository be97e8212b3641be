#!/usr/bin/env bash
# ckpt_cuda_check.sh - build bench/ckpt_cuda_check.c against a CUDA libtorch
# (default: pip's torch package folder) and run it: checkpoint tensors loaded
# into an architecture on the GPU forward like PyTorch. Needs g++, gcc and the
# CUDA toolkit headers (CUDA_HOME); none of the server's other libraries.
#   bench/ckpt_cuda_check.sh [LIBTORCH] [DEVICE]
set -eu
cd "$(dirname "$0")/.."
LIBTORCH=${1:-$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')}
DEVICE=${2:-cuda}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
out=build/ckpt_cuda
mkdir -p $out
abi=$(python3 -c 'import torch;print(int(torch._C._GLIBCXX_USE_CXX11_ABI))' 2>/dev/null || echo 1)
g++ -std=c++17 -O1 -Wall -Wextra -Werror -Wno-unused-parameter -D_GLIBCXX_USE_CXX11_ABI=$abi \
  -DWITH_CUDA=1 -isystem "$LIBTORCH/include" -isystem "$LIBTORCH/include/torch/csrc/api/include" \
  -isystem "$CUDA_HOME/include" -c predictor/torch_backend.cpp -o $out/torch_backend.o
for f in config/md_err.c checkpoint/named_tensors.c checkpoint/pickle.c checkpoint/torch_zip.c \
         bench/ckpt_cuda_check.c; do
  gcc -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -O1 -Wall -Wextra -Werror \
    -c "$f" -o "$out/$(basename "$f" .c).o"
done
g++ -o $out/ckpt_cuda_check $out/*.o -L"$LIBTORCH/lib" -Wl,-rpath,"$LIBTORCH/lib" \
  -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10 -ltorch_cuda -lc10_cuda -Wl,--as-needed \
  -L"$CUDA_HOME/lib64" -Wl,-rpath,"$CUDA_HOME/lib64" -lcudart -lm -pthread
$out/ckpt_cuda_check "$DEVICE"
