#!/usr/bin/env bash
# gpu_check.sh - build modeld against a CUDA libtorch and check the CUDA path on
# a machine with a GPU (not part of `make test`: CI has no GPU).
#
#   bench/gpu_check.sh [DEPS [LIBTORCH]]
#
# DEPS: a folder holding Debian 12 packages unpacked with `dpkg -x` (the -dev
#   and runtime packages of libmicrohttpd, jansson, sqlite3, libcurl and its
#   runtime deps, openssl, zlib, isa-l, cmocka), for machines without them; empty or
#   "-": use the system's.
# LIBTORCH: a CUDA libtorch; default: the folder of the python3 torch package
#   (pip's torch holds include/ and lib/ of a CUDA libtorch).
# Environment: FMNIST_DIR (the FashionMNIST t10k IDX.gz, for the job check),
#   BENCH_SECONDS, BENCH_CLIENTS, MIXED_ROWS (bench/gpu_check.py), INPROC_SECONDS
#   (bench/inprocess.c on cuda and cpu; 0 skips it), GPU_CHECK_E2E=1 to run
#   tests/e2e/test_predict.py, test_jobs.py and test_protocols.py against the CUDA build too, UNIT=1 for `make unit`.
#
# Prints PASS/FAIL lines; exits non-zero if any check failed.
set -u
cd "$(dirname "$0")/.."
DEPS=${1:-}
[ "$DEPS" = "-" ] && DEPS=
LIBTORCH=${2:-$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')}
fail=0
pass() { echo "PASS $*"; }
failed() { echo "FAIL $*"; fail=1; }

echo "== machine"
grep PRETTY_NAME /etc/os-release
ldd --version | head -1
${CXX:-g++} --version | head -1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(), "cxx11abi", torch._C._GLIBCXX_USE_CXX11_ABI)'
echo "LIBTORCH=$LIBTORCH"

extra_c=() extra_ld=()
if [ -n "$DEPS" ]; then
  DEPS=$(cd "$DEPS" && pwd)
  lib=$DEPS/usr/lib/x86_64-linux-gnu
  extra_c=("EXTRA_CFLAGS=-isystem $DEPS/usr/include -isystem $DEPS/usr/include/x86_64-linux-gnu -isystem $DEPS/usr/include/postgresql")
  extra_ld=("EXTRA_LDFLAGS=-L$lib -Wl,-rpath-link,$lib")
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
mk=(make -j"$(nproc)" WITH_CUDA=1 "LIBTORCH=$LIBTORCH" "${extra_c[@]}" "${extra_ld[@]}")

echo "== build"
mkdir -p build
if "${mk[@]}" all >build/gpu_build.log 2>&1; then
  pass "make WITH_CUDA=1 all (-Werror)"
else
  grep -E 'error|warning' build/gpu_build.log | head -30
  failed "make WITH_CUDA=1 all (-Werror)"
  echo "retrying without -Werror to run the checks"
  "${mk[@]}" WARN="-Wall -Wextra" all >build/gpu_build2.log 2>&1 || { tail -40 build/gpu_build2.log; exit 1; }
fi
missing=$(ldd ./modeld | grep 'not found')
[ -z "$missing" ] && pass "every shared library of modeld resolves" || failed "ldd modeld: $missing"
ldd ./modeld | grep -E 'torch|c10|cuda|microhttpd|curl' | sed 's/^/  /'
ver=$(./modeld --version 2>&1)
echo "$ver"
case $ver in *CUDA*) pass "modeld --version says CUDA" ;; *) failed "modeld --version: $ver" ;; esac

if [ "${UNIT:-0}" = 1 ]; then
  echo "== unit tests (CUDA libtorch linked)"
  if "${mk[@]}" unit >build/gpu_unit.log 2>&1; then pass "make unit"; else tail -30 build/gpu_unit.log; failed "make unit"; fi
fi

if [ "${INPROC_SECONDS:-3}" != 0 ]; then
  echo "== in-process forward ceiling (bench/inprocess.c, no HTTP), FashionMNIST MLP"
  if "${mk[@]}" build/bench/inprocess >build/gpu_inproc_build.log 2>&1; then
    t=${INPROC_SECONDS:-3}
    build/bench/inprocess --device cuda --batch 64,1024 --threads 4 --seconds "$t" || failed "inprocess cuda"
    build/bench/inprocess --device cuda --batch 64 --threads "$(nproc)" --seconds "$t" || failed "inprocess cuda"
    build/bench/inprocess --device cpu --batch 64,1024 --threads "$(nproc)" --seconds "$t" || failed "inprocess cpu"
  else
    tail -20 build/gpu_inproc_build.log; failed "build bench/inprocess"
  fi
fi

echo "== checks"
MODELD_BIN=$PWD/modeld PYTHONUNBUFFERED=1 python3 bench/gpu_check.py || fail=1

if [ "${GPU_CHECK_E2E:-0}" = 1 ]; then
  echo "== tests/e2e/test_predict.py, test_jobs.py and test_protocols.py against the CUDA build (models on cpu)"
  # the e2e tests read the FashionMNIST set where Debian's package puts it; the
  # path guard refuses a symlink out of the allowed folder, so copy it there
  ds=/usr/share/datasets/fashion-mnist
  if [ ! -e "$ds/t10k-images-idx3-ubyte.gz" ] && [ -e "${FMNIST_DIR:-}/t10k-images-idx3-ubyte.gz" ]; then
    mkdir -p "$ds" && cp "$FMNIST_DIR"/*-ubyte.gz "$ds"/ && echo "copied $FMNIST_DIR to $ds"
  fi
  if MODELD_BIN=$PWD/modeld python3 -m pytest -q -p no:cacheprovider tests/e2e/test_predict.py \
       tests/e2e/test_jobs.py tests/e2e/test_protocols.py \
       >build/gpu_e2e.log 2>&1; then
    pass "e2e test_predict.py test_jobs.py test_protocols.py: $(tail -1 build/gpu_e2e.log)"
  else
    grep -E "^(FAILED|ERROR)" build/gpu_e2e.log | head -20
    failed "e2e test_predict.py test_jobs.py test_protocols.py: $(tail -1 build/gpu_e2e.log)"
  fi
fi
exit $fail
