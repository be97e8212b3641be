# modeld - build, run, test. `make run` and `make test` install missing
# Debian packages first (make deps), so each works alone on a fresh Debian 12.

CC      ?= cc
CXX     ?= g++
PYTHON  := /usr/bin/python3
# `make run PORT=9000` or `make run ARGS='--port 9000 --workers 2'`; MODELD_*
# variables work too (flags win over them, so PORT is passed only when given).
# `make run DATA=/path[,/other]` adds directories to serve.sh's allowed_paths
# (--allowed-paths in ARGS would replace the ones README's commands need).
PORT    ?=
ARGS    ?=
DATA    ?=

# Debian packages the build, the tests and the benchmarks need (nginx: run as a
# plain subprocess by tests/e2e/test_nginx.py, no system service is needed).
# BUILD_PACKAGES build ./modeld (the Docker build stage installs only these).
BUILD_PACKAGES := build-essential pkg-config libmicrohttpd-dev libjansson-dev libsqlite3-dev libpq-dev \
	libcurl4-openssl-dev libssl-dev zlib1g-dev libtorch-dev libopenblas0-pthread \
	libfast-float-dev libpng-dev libjpeg62-turbo-dev libisal-dev
DEB_PACKAGES := $(BUILD_PACKAGES) libcmocka-dev python3 python3-pytest python3-requests \
	python3-numpy python3-yaml python3-torch curl ca-certificates sqlite3 dataset-fashion-mnist \
	git jq nginx python3-pil python3-torchvision postgresql-15 nodejs npm python3-boto3
# IMAGE_PACKAGES: `make image-check` only (builds and runs the image without Docker)
IMAGE_PACKAGES := buildah debootstrap crun fuse-overlayfs

# libtorch: Debian's CPU build by default; WITH_CUDA=1 LIBTORCH=<dir> for a CUDA one
# (a libtorch tree, or pip's torch package folder, whose include/ and lib/ are one).
# Its headers are -isystem: a newer libtorch's own warnings must not fail -Werror.
LIBTORCH ?=
CUDA_HOME ?= /usr/local/cuda
ifeq ($(LIBTORCH),)
TORCH_CFLAGS := -I/usr/include/torch/csrc/api/include
TORCH_LIBS   := -ltorch -ltorch_cpu -lc10
else
TORCH_CFLAGS := -isystem $(LIBTORCH)/include -isystem $(LIBTORCH)/include/torch/csrc/api/include
ifeq ($(WITH_CUDA),1)
# c10/cuda's headers include the CUDA runtime's
TORCH_CFLAGS += -isystem $(CUDA_HOME)/include
endif
TORCH_LIBS   := -L$(LIBTORCH)/lib -Wl,-rpath,$(LIBTORCH)/lib -Wl,--no-as-needed -ltorch \
	-ltorch_cpu -lc10
ifeq ($(WITH_CUDA),1)
# c10/cuda's inline functions (the stream guard's) call the CUDA runtime
# directly, so the backend needs libcudart itself, from the CUDA toolkit
TORCH_LIBS   += -ltorch_cuda -lc10_cuda -Wl,--as-needed -L$(CUDA_HOME)/lib64 \
	-Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart
endif
endif
ifeq ($(WITH_CUDA),1)
TORCH_CFLAGS += -DWITH_CUDA=1
endif

# The index in PostgreSQL (index_url=postgresql://...): libpq; WITH_PG=0
# builds without it (such an index_url is then refused as not built).
WITH_PG ?= 1
ifeq ($(WITH_PG),1)
PG_CFLAGS := -DMD_WITH_PG=1 $(shell pkg-config --cflags libpq 2>/dev/null || echo -I/usr/include/postgresql)
PG_LIBS   := $(shell pkg-config --libs libpq 2>/dev/null || echo -lpq)
else
PG_CFLAGS :=
PG_LIBS   :=
endif

SAN_FLAGS ?=
# Hooks for dependencies outside the system paths, e.g. Debian packages
# unpacked into DIR (bench/gpu_check.sh): EXTRA_CFLAGS=-IDIR/usr/include
# EXTRA_LDFLAGS=-LDIR/usr/lib/x86_64-linux-gnu
EXTRA_CFLAGS  ?=
EXTRA_LDFLAGS ?=
OPT       ?= -O2 -g
# GCC's -O2 vectorizes only loops of known trip count; the row conversions and
# preprocess loops that jobs run per row need the cheap model (clang: default)
VECT      := $(if $(shell $(CC) --version 2>/dev/null | grep -q clang || echo gcc),-fvect-cost-model=cheap,)
WARN      := -Wall -Wextra -Werror
CFLAGS    := -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE $(OPT) $(VECT) $(WARN) -pthread $(PG_CFLAGS) $(SAN_FLAGS) $(EXTRA_CFLAGS)
CXXFLAGS  := -std=c++17 $(OPT) $(WARN) -Wno-unused-parameter -pthread $(TORCH_CFLAGS) $(SAN_FLAGS) \
	$(EXTRA_CFLAGS)
LIBS      := $(EXTRA_LDFLAGS) -lmicrohttpd -ljansson -lsqlite3 $(PG_LIBS) -lcurl -lcrypto -lz -lisal -lpng -ljpeg $(TORCH_LIBS) -lstdc++ -lm -pthread

BUILD := build$(if $(SAN_FLAGS),-asan,)

# every C module but main.c; the binary and the unit tests link these
LIB_C   := config/md_err.c config/md_json.c config/md_metrics.c config/config.c server/router.c server/http.c \
	server/multipart.c checkpoint/store.c checkpoint/index.c checkpoint/index_sqlite.c \
	checkpoint/versions.c checkpoint/promotion.c checkpoint/retention.c checkpoint/traffic.c checkpoint/blobs.c checkpoint/archive.c \
	checkpoint/download.c checkpoint/named_tensors.c checkpoint/pickle.c checkpoint/torch_zip.c checkpoint/zipdir.c \
	checkpoint/safetensors.c predictor/model_config.c predictor/image.c predictor/tensor.c predictor/npy.c predictor/npz.c predictor/v2.c predictor/batcher.c predictor/model.c predictor/registry.c \
	jobs/readers.c jobs/scheduler.c jobs/writers.c jobs/job_store.c handlers/app.c handlers/jobs.c \
	handlers/deploy.c handlers/upload.c handlers/models.c handlers/traffic.c handlers/shadow.c handlers/predict.c handlers/answer.c \
	handlers/routes.c handlers/health.c handlers/openapi.c
ifeq ($(WITH_PG),1)
LIB_C   += checkpoint/index_pg.c
endif
# training checkpoints: weights apart from their architecture (issue 12)
LIB_C   += predictor/weights.c handlers/training.c handlers/metrics.c
# jobs over image folders (issue 15)
LIB_C   += jobs/images.c
# S3 image folders split by index over every replica (issue 26)
LIB_C   += jobs/s3_images.c
# npz datasets: one array per named input (issue 27)
LIB_C   += jobs/npzset.c
# IDX.gz inflated by ISA-L (issue 14: the runner's cost of an IDX.gz row)
LIB_C   += jobs/gzstream.c
LIB_C   += jobs/filerange.c
# where a job's output lives: cluster jobs' outputs in the blob store's bucket (issue 26)
LIB_C   += jobs/job_output.c
# removing ended jobs: job_retention_s, DELETE /jobs/ID?purge=true
LIB_C   += jobs/job_retention.c
# one rule for how an output row reads as classes (issue 29: binary, multi-label)
LIB_C   += predictor/classes.c
# several named inputs and outputs (issue 27)
LIB_C   += predictor/inputs.c predictor/rows.c
# the S3 client the blob store and s3:// sources are built on (issue 25)
LIB_C   += checkpoint/s3.c
# the blobs seam (blobs_impl.h): a directory (default) or S3 with a local cache
LIB_C   += checkpoint/blobs_dir.c checkpoint/blobs_s3.c
# job datasets in S3: inputs streamed by Range, image folders, outputs (issue 26)
LIB_C   += checkpoint/s3_data.c
LIB_CXX := predictor/torch_backend.cpp predictor/numparse.cpp
LIB_S   := handlers/openapi_blob.S
LIB_OBJ := $(LIB_C:%.c=$(BUILD)/%.o) $(LIB_CXX:%.cpp=$(BUILD)/%.o) $(LIB_S:%.S=$(BUILD)/%.o)

UNIT_TESTS := test_config test_router test_store test_tensor test_readers test_batcher test_formats \
	test_image test_multipart
# NPZ bodies (issue 27) over archives numpy wrote (tests/fixtures/npz/); the checked
# allocator is wrapped to see lying sizes refused before they are allocated
UNIT_TESTS += test_npz
LDFLAGS_test_npz := -Wl,--wrap=md_malloc_checked -Wl,--wrap=md_mallocarray_checked
# the S3 client against a loopback listener: AWS's SigV4 examples, failures, resume
UNIT_TESTS += test_s3
# the blobs seam's conformance suite: the directory here, S3 under tests/with_s3.sh
# (tests/e2e/test_blobs_seam.py in make e2e)
UNIT_TESTS += test_blobs
# the batcher is tested over a fake backend: the linker seam replaces libtorch calls
LDFLAGS_test_batcher := -Wl,--wrap=md_torch_load -Wl,--wrap=md_torch_forward -Wl,--wrap=md_torch_free \
    -Wl,--wrap=md_torch_replica -Wl,--wrap=md_torch_forward_quiet \
    -Wl,--wrap=md_torch_resident_bytes
UNIT_BINS  := $(UNIT_TESTS:%=$(BUILD)/tests/%)

MODELD := $(if $(SAN_FLAGS),$(BUILD)/modeld,modeld)

.PHONY: all run test unit unit-pg e2e asan tsan faults soak bench deps deps-build clean lint-openapi fixtures \
	fixtures-check fuzz s3rver s3-live bench-cluster bench-shadow bench-multi-io bench-jobs-cluster \
	cuda-compile-check docker-check image-check deps-image

all: $(MODELD)

$(MODELD): $(BUILD)/server/main.o $(LIB_OBJ)
	$(CC) $(CFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/%.o: %.c $(wildcard */*.h)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/%.o: %.cpp $(wildcard */*.h)
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -c -o $@ $<

$(BUILD)/handlers/openapi_blob.o: handlers/openapi_blob.S openapi.yaml
	@mkdir -p $(dir $@)
	$(CC) -c -DOPENAPI_PATH='"$(CURDIR)/openapi.yaml"' -o $@ $<

$(BUILD)/tests/%: tests/%.c tests/test_util.h $(LIB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $(filter-out %.h,$^) $(LDFLAGS_$*) $(LIBS) -lcmocka

# Install the Debian packages that are missing (non-interactive). npm counts
# as present when an npm command is: NodeSource's nodejs package ships its own
# npm and conflicts with Debian's. `make deps` then installs s3rver (below).
deps deps-build deps-image:
	@missing=""; for p in $(if $(filter deps-build,$@),$(BUILD_PACKAGES),$(if $(filter deps-image,$@),$(IMAGE_PACKAGES),$(DEB_PACKAGES))); do \
	  if [ "$$p" = npm ] && command -v npm >/dev/null 2>&1; then continue; fi; \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@if [ "$@" = deps ]; then $(MAKE) --no-print-directory s3rver || \
	  echo "warning: s3rver was not installed (npm failed): the S3 tests need it"; fi

# npm's s3rver, the S3 server of the tests (tests/e2e/s3.py, tests/with_s3.sh),
# pinned with its dependencies by tests/s3rver/package-lock.json, installed
# into build/tools/s3rver (git-ignored), never globally.
S3RVER := build/tools/s3rver/node_modules/s3rver/bin/s3rver.js
$(S3RVER): tests/s3rver/package.json tests/s3rver/package-lock.json
	@mkdir -p build/tools/s3rver
	cp tests/s3rver/package.json tests/s3rver/package-lock.json build/tools/s3rver/
	cd build/tools/s3rver && npm ci --no-audit --no-fund --loglevel=error
	touch $@
s3rver: $(S3RVER)

# The S3 client against s3rver behind the SigV4-checking proxy (also run by
# tests/e2e/test_s3_harness.py in make e2e).
s3-live: $(BUILD)/tests/test_s3_live $(S3RVER)
	tests/with_s3.sh $(BUILD)/tests/test_s3_live

# Serve on :8080 with the committed FashionMNIST model deployed as `fashion`
# (examples/serve.sh deploys it when the store ./modeld-data does not have it).
run: deps
	$(MAKE) all
	OPENBLAS_NUM_THREADS=1 DATA='$(DATA)' examples/serve.sh $(if $(PORT),--port $(PORT)) $(ARGS)

unit: $(UNIT_BINS)
	@fail=0; for t in $(UNIT_BINS); do echo "== $$t"; $$t || fail=1; done; exit $$fail

# The store's suite (test_store: versions, retention, GC, jobs, leases) again
# with the index in PostgreSQL 15: tests/with_pg.sh starts a throwaway
# cluster (as nobody, on a private socket and port) and stops it after.
unit-pg: $(BUILD)/tests/test_store
	$(if $(filter 1,$(WITH_PG)),tests/with_pg.sh $(BUILD)/tests/test_store,@echo "unit-pg: skipped (WITH_PG=0)")

# promtool (tests/e2e/test_metrics.py checks GET /metrics with it) comes from
# Debian's prometheus package, unpacked here rather than installed: installing
# it would start a Prometheus server on the machine
PROMTOOL := build/tools/usr/bin/promtool
$(PROMTOOL):
	@mkdir -p build/tools
	cd build/tools && rm -f prometheus_*.deb && \
	  { apt-get download prometheus 2>/dev/null || \
	    { $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -qq && apt-get download prometheus; }; } && \
	  dpkg-deb -x prometheus_*.deb . && rm -f prometheus_*.deb && touch usr/bin/promtool

e2e: $(MODELD) $(PROMTOOL) $(S3RVER) $(BUILD)/tests/test_s3_live $(BUILD)/tests/test_blobs
	MODELD_BIN=$(CURDIR)/$(MODELD) PROMTOOL=$(CURDIR)/$(PROMTOOL) \
	  S3_LIVE_BIN=$(CURDIR)/$(BUILD)/tests/test_s3_live \
	  BLOBS_TEST_BIN=$(CURDIR)/$(BUILD)/tests/test_blobs $(PYTHON) -m pytest -q tests/e2e \
	  $(PYTEST_ARGS)


lint-openapi:
	@if command -v npx >/dev/null 2>&1; then \
	  npx --yes @redocly/cli@2.77.0 lint --format=stylish openapi.yaml; \
	else echo "npx not found: skipping the openapi.yaml lint (install nodejs and npm)"; fi

test: deps
	$(MAKE) all
	$(MAKE) unit
	$(MAKE) unit-pg
	$(MAKE) e2e
	$(MAKE) fixtures-check
	$(MAKE) lint-openapi
	$(MAKE) cuda-compile-check
	$(MAKE) docker-check

# The Docker image's steps without a Docker engine (docker/steps.sh check).
docker-check: deps
	docker/steps.sh check

# The image itself, built from docker/Dockerfile as it is and run, with no
# Docker engine: buildah (chroot isolation, vfs) over a debian:12-slim made
# with debootstrap (cached in build/image/); /readyz, deploy, predict, SIGTERM
# drain, image size (docker/image-check.sh). Needs root (sudo otherwise);
# about 5 minutes cold.
image-check: deps deps-image
	$$( [ "$$(id -u)" = 0 ] || echo sudo ) docker/image-check.sh

# Address + undefined sanitizers over the whole suite, in a separate build dir.
asan: deps
	$(MAKE) SAN_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" \
	  OPT="-O1 -g" ASAN_E2E=1 unit unit-pg e2e

# The real binary under faults (tests/e2e/test_faults.py, also part of make
# test): kill -9 during 50 deploys, a full disk (a tmpfs: needs root), a
# corrupt blob, a model that throws for some requests; and in a memory cgroup
# of 1 GiB (test_memory_limit.py: needs a writable cgroup, skipped otherwise)
# the hostile requests of issue 24 and 10 deploys of a 192 MB model.
faults: all
	MODELD_BIN=$(CURDIR)/$(MODELD) $(PYTHON) -m pytest -q tests/e2e/test_faults.py \
	  tests/e2e/test_memory_limit.py $(PYTEST_ARGS)

# Five minutes of mixed load at 80% of capacity (predictions, deploys and
# deletes, jobs), RSS flat after warm-up, 100 deploy/delete cycles without
# growth (bench/soak.py; not part of make test: it takes about 7 minutes).
SOAK_ARGS ?=
soak: all
	$(PYTHON) bench/soak.py --modeld $(CURDIR)/modeld $(SOAK_ARGS)

# ThreadSanitizer over the modules with threads of their own (the batcher and
# registry, the store, the readers) and the end-to-end tests that drive
# concurrency: concurrent and split requests, hot swaps, jobs beside online
# traffic, replicas sharing a store, drains. TSAN_E2E=1 stops every server with
# SIGTERM and fails a test whose server printed a ThreadSanitizer report.
TSAN_E2E_TESTS := concurrent or split or max_delay or hot_swap or queue_full or timeout or \
	client_disconnect or replica or job_and_online or cancel or drain or in_flight or \
	off_the_http_thread or large_json_requests or sigterm_under_load
tsan: deps
	$(MAKE) SAN_FLAGS="-fsanitize=thread" OPT="-O1 -g" BUILD=build-tsan TSAN_E2E=1 \
	  UNIT_TESTS="test_batcher test_store test_readers" \
	  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$(CURDIR)/tests/tsan.supp" \
	  PYTEST_ARGS="-k '$(TSAN_E2E_TESTS)'" unit e2e

# Rewrite tests/fixtures; fixtures-check regenerates them into a temporary
# directory and compares values (the archives' bytes are not reproducible:
# see tests/fixtures/README.md).
fixtures:
	$(PYTHON) tests/fixtures/make_fixtures.py
	$(PYTHON) tests/fixtures/make_images.py
	$(PYTHON) tests/fixtures/make_multi_io.py
	$(PYTHON) tests/fixtures/make_npz.py

fixtures-check:
	$(PYTHON) tests/fixtures/make_fixtures.py --check
	$(PYTHON) tests/fixtures/make_images.py --check
	$(PYTHON) tests/fixtures/make_multi_io.py --check
	$(PYTHON) tests/fixtures/make_npz.py --check

# the backend reads checkpoint tensors too (md_torch_load_state): it needs their helpers
$(BUILD)/bench/inprocess: bench/inprocess.c $(BUILD)/predictor/torch_backend.o $(BUILD)/config/md_err.o $(BUILD)/config/md_json.o \
	$(BUILD)/checkpoint/named_tensors.o $(BUILD)/predictor/image.o
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ $(LIBS)

TENSOR_OBJ := $(BUILD)/predictor/tensor.o $(BUILD)/predictor/npy.o $(BUILD)/predictor/npz.o \
	$(BUILD)/predictor/v2.o
$(BUILD)/bench/decode: bench/decode.c $(TENSOR_OBJ) $(BUILD)/predictor/numparse.o \
	$(BUILD)/config/md_err.o $(BUILD)/config/md_json.o
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ -ljansson -lz -lstdc++ -lm

$(BUILD)/bench/encode: bench/encode.c $(BUILD)/handlers/answer.o $(BUILD)/predictor/classes.o $(TENSOR_OBJ) \
	$(BUILD)/predictor/numparse.o $(BUILD)/config/md_err.o $(BUILD)/config/md_json.o
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $^ -ljansson -lz -lstdc++ -lm

bench: deps
	$(MAKE) all $(BUILD)/bench/inprocess $(BUILD)/bench/decode $(BUILD)/bench/encode
	$(BUILD)/bench/decode
	$(BUILD)/bench/encode
	bash bench/run.sh
	$(PYTHON) bench/memory.py --modeld $(CURDIR)/$(MODELD)
	$(MAKE) --no-print-directory bench-cluster
	$(MAKE) --no-print-directory bench-shadow
	$(MAKE) --no-print-directory bench-multi-io
	$(MAKE) --no-print-directory bench-jobs-cluster

# Named inputs and outputs (issue 27): the single-input figures of the build
# before them and of this one side by side, then the two-input model under
# the same load in each request form (bench/multi_io.sh).
bench-multi-io: deps
	$(MAKE) all
	bash bench/multi_io.sh

# Safe rollouts (issue 28): the primary's answers with and without a 100 %
# shadow version, side by side under the same wrk loads (bench/shadow.py).
bench-shadow: deps
	$(MAKE) all
	$(PYTHON) bench/shadow.py --modeld $(CURDIR)/$(MODELD)

# Several hosts (issue 25): single-host and cluster mode (index_url on a
# throwaway PostgreSQL 15) side by side under the same wrk load, and how fast
# a change through one replica reaches another (bench/cluster.py).
bench-cluster: deps
	$(MAKE) all
	$(PYTHON) bench/cluster.py --modeld $(CURDIR)/$(MODELD)

# One job over every replica (issue 26): a 1M-row NPY job in S3 in
# single-host mode and on 1, 2 and 3 replicas of one PostgreSQL index, and the
# chunk claim rate (bench/jobs_cluster.py; s3rver from `make s3rver`).
bench-jobs-cluster: deps $(S3RVER)
	$(MAKE) all
	$(PYTHON) bench/jobs_cluster.py --modeld $(CURDIR)/$(MODELD)

clean:
	rm -rf build build-asan build-tsan build-fuzz modeld

# libFuzzer over the request decoders, the dataset readers, the configuration
# loader, the router, the multipart/form-data iterator, the checkpoint readers,
# image input and the S3 client's XML answers (clang); not part of `make test`. FUZZ_SECONDS per target.
FUZZ_SECONDS ?= 60
TENSOR_SRC := predictor/tensor.c predictor/npy.c predictor/npz.c predictor/v2.c predictor/rows.c
# FUZZ_RUNS=1000000 runs each target that many executions instead of FUZZ_SECONDS
FUZZ_RUNS ?=
FUZZ_LIMIT = $(if $(FUZZ_RUNS),-runs=$(FUZZ_RUNS),-max_total_time=$(FUZZ_SECONDS))
# the checkpoint readers' memory limits, small enough for libFuzzer's 2 GB
FUZZ_CKPT_LIMITS := -DMD_CKPT_MAX_TOTAL_BYTES='(64LL << 20)' -DMD_PICKLE_MAX_ARENA='(64LL << 20)'
fuzz:
	@mkdir -p build-fuzz
	clang++ -std=c++17 -g -O1 -fsanitize=fuzzer-no-link,address,undefined \
	  -c predictor/numparse.cpp -o build-fuzz/numparse.o
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_number tests/fuzz_number.c \
	  $(TENSOR_SRC) build-fuzz/numparse.o config/md_err.c config/md_json.c -ljansson -lz -lstdc++ -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_tensor tests/fuzz_tensor.c \
	  $(TENSOR_SRC) build-fuzz/numparse.o config/md_err.c config/md_json.c -ljansson -lz -lstdc++ -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_readers tests/fuzz_readers.c \
	  jobs/readers.c jobs/gzstream.c jobs/images.c jobs/npzset.c predictor/image.c $(TENSOR_SRC) \
	  build-fuzz/numparse.o config/md_err.c config/md_json.c -ljansson -lpng -ljpeg -lz -lisal -lstdc++ -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_v2 tests/fuzz_v2.c \
	  $(TENSOR_SRC) build-fuzz/numparse.o config/md_err.c config/md_json.c -ljansson -lz -lstdc++ -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_named tests/fuzz_named.c \
	  $(TENSOR_SRC) build-fuzz/numparse.o config/md_err.c config/md_json.c -ljansson -lz -lstdc++ -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_npz tests/fuzz_npz.c \
	  $(TENSOR_SRC) build-fuzz/numparse.o config/md_err.c config/md_json.c -ljansson -lz -lstdc++ -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_model_config \
	  tests/fuzz_model_config.c predictor/model_config.c predictor/image.c config/md_err.c config/md_json.c \
	  -ljansson -lpng -ljpeg -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_config tests/fuzz_config.c \
	  config/config.c config/md_err.c config/md_json.c -ljansson -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_router tests/fuzz_router.c \
	  server/router.c config/md_err.c config/md_json.c -ljansson -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined $(FUZZ_CKPT_LIMITS) -o build-fuzz/fuzz_pickle \
	  tests/fuzz_pickle.c checkpoint/pickle.c checkpoint/named_tensors.c config/md_err.c config/md_json.c -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_zipdir \
	  tests/fuzz_zipdir.c checkpoint/zipdir.c config/md_err.c config/md_json.c -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined $(FUZZ_CKPT_LIMITS) -o build-fuzz/fuzz_safetensors \
	  tests/fuzz_safetensors.c checkpoint/safetensors.c checkpoint/named_tensors.c \
	  config/md_err.c config/md_json.c -ljansson -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_image tests/fuzz_image.c \
	  predictor/image.c config/md_err.c config/md_json.c -ljansson -lpng -ljpeg -lz -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_multipart tests/fuzz_multipart.c \
	  server/multipart.c config/md_err.c config/md_json.c -lm
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -DMD_GZ_IN_SIZE=32 -DMD_GZ_OUT_SIZE=32 \
	  -o build-fuzz/fuzz_gzstream tests/fuzz_gzstream.c jobs/gzstream.c -lisal -lz
	clang -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -g -O1 \
	  -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz_s3_xml tests/fuzz_s3_xml.c \
	  checkpoint/s3.c config/md_err.c -lcurl -lcrypto -lm
	mkdir -p build-fuzz/corpus_number && cp tests/fuzz_corpus_number/* build-fuzz/corpus_number/
	mkdir -p build-fuzz/corpus_s3_xml && cp tests/fuzz_corpus_s3_xml/* build-fuzz/corpus_s3_xml/
	mkdir -p build-fuzz/corpus_gzstream && cp tests/fuzz_corpus_gzstream/* build-fuzz/corpus_gzstream/
	mkdir -p build-fuzz/corpus build-fuzz/corpus_readers build-fuzz/corpus_config \
	  build-fuzz/corpus_router build-fuzz/corpus_pickle build-fuzz/corpus_safetensors
	cp tests/fuzz_corpus/* build-fuzz/corpus/
	cp tests/fuzz_corpus_readers/* build-fuzz/corpus_readers/
	cp tests/fuzz_corpus_config/* build-fuzz/corpus_config/
	mkdir -p build-fuzz/corpus_v2 && cp tests/fuzz_corpus_v2/* build-fuzz/corpus_v2/
	mkdir -p build-fuzz/corpus_named && cp tests/fuzz_corpus_named/* build-fuzz/corpus_named/
	mkdir -p build-fuzz/corpus_npz && cp tests/fuzz_corpus_npz/* build-fuzz/corpus_npz/
	mkdir -p build-fuzz/corpus_model_config && \
	  cp tests/fuzz_corpus_model_config/* build-fuzz/corpus_model_config/
	cp tests/fuzz_corpus_router/* build-fuzz/corpus_router/
	cp tests/fuzz_corpus_pickle/* build-fuzz/corpus_pickle/
	cp tests/fuzz_corpus_safetensors/* build-fuzz/corpus_safetensors/
	mkdir -p build-fuzz/corpus_zipdir && cp tests/fuzz_corpus_zipdir/* build-fuzz/corpus_zipdir/
	mkdir -p build-fuzz/corpus_image && cp tests/fuzz_corpus_image/* build-fuzz/corpus_image/
	mkdir -p build-fuzz/corpus_multipart && cp tests/fuzz_corpus_multipart/* build-fuzz/corpus_multipart/
	build-fuzz/fuzz_number $(FUZZ_LIMIT) -max_len=256 -dict=tests/fuzz_number.dict \
	  build-fuzz/corpus_number
	build-fuzz/fuzz_tensor $(FUZZ_LIMIT) -max_len=4096 build-fuzz/corpus
	build-fuzz/fuzz_readers $(FUZZ_LIMIT) -max_len=4096 build-fuzz/corpus_readers
	build-fuzz/fuzz_v2 $(FUZZ_LIMIT) -max_len=4096 build-fuzz/corpus_v2
	build-fuzz/fuzz_named $(FUZZ_LIMIT) -max_len=4096 build-fuzz/corpus_named
	build-fuzz/fuzz_npz $(FUZZ_LIMIT) -max_len=8192 build-fuzz/corpus_npz
	build-fuzz/fuzz_model_config $(FUZZ_LIMIT) -max_len=2048 build-fuzz/corpus_model_config
	build-fuzz/fuzz_config $(FUZZ_LIMIT) -max_len=2048 build-fuzz/corpus_config
	build-fuzz/fuzz_router $(FUZZ_LIMIT) -max_len=1024 build-fuzz/corpus_router
	build-fuzz/fuzz_pickle $(FUZZ_LIMIT) -max_len=16384 build-fuzz/corpus_pickle
	build-fuzz/fuzz_safetensors $(FUZZ_LIMIT) -max_len=4096 \
	  build-fuzz/corpus_safetensors
	build-fuzz/fuzz_zipdir $(FUZZ_LIMIT) -max_len=16384 build-fuzz/corpus_zipdir
	build-fuzz/fuzz_image $(FUZZ_LIMIT) -max_len=16384 build-fuzz/corpus_image
	build-fuzz/fuzz_multipart $(FUZZ_LIMIT) -max_len=4096 build-fuzz/corpus_multipart
	build-fuzz/fuzz_gzstream $(FUZZ_LIMIT) -max_len=65536 build-fuzz/corpus_gzstream
	build-fuzz/fuzz_s3_xml $(FUZZ_LIMIT) -max_len=4096 build-fuzz/corpus_s3_xml

# The CUDA path of the backend must keep compiling even where no CUDA libtorch
# exists to link it: compile it against Debian's libtorch headers and the CUDA
# toolkit's (Debian omits one generated c10 header; a stub stands in for it).
cuda-compile-check:
	@if [ -f $(CUDA_HOME)/include/cuda_runtime.h ]; then \
	  mkdir -p build/cudastub/c10/cuda/impl && \
	  echo '#define C10_CUDA_BUILD_SHARED_LIBS' > build/cudastub/c10/cuda/impl/cuda_cmake_macros.h && \
	  $(CXX) -std=c++17 -O0 $(WARN) -Wno-unused-parameter -pthread -Ibuild/cudastub \
	    -I/usr/include/torch/csrc/api/include -I$(CUDA_HOME)/include -DWITH_CUDA=1 \
	    -c predictor/torch_backend.cpp -o build/torch_backend_cuda.o && \
	  echo "cuda-compile-check: the WITH_CUDA backend compiles"; \
	else echo "cuda-compile-check: no CUDA toolkit at $(CUDA_HOME); skipped"; fi
