#!/usr/bin/env bash
# docker/steps.sh - the image recipe's steps, kept out of the Dockerfile so CI
# can run them on a machine without a Docker engine (`make docker-check`).
#
#   docker/steps.sh build    the build stage: Debian build packages, then ./modeld
#   docker/steps.sh runtime  the runtime stage: the packages in docker/runtime-packages
#                            (beside this script: the image copies both to /tmp/docker)
#   docker/steps.sh check    CI, no Docker: build from a copy of the tracked files as
#                            the build stage does, prove the runtime packages provide
#                            every library the binary links, then run the binary with
#                            the Dockerfile's ENV, HEALTHCHECK and STOPSIGNAL
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export DEBIAN_FRONTEND=noninteractive

log() { printf 'docker/steps.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
packages() { grep -v '^#' docker/runtime-packages | grep -v '^$'; }

step_build() {
    if ! command -v make >/dev/null; then # debian:12-slim has no make
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends make
    fi
    make deps-build
    make -j"$(nproc)" modeld
}

step_runtime() {
    apt-get update -qq
    # shellcheck disable=SC2046
    apt-get install -y -qq --no-install-recommends $(packages)
    rm -rf /var/lib/apt/lists/*
}

# The Debian packages that own the libraries `bin` links, one per line.
owners_of_libs() {
    ldd "$1" | awk '/=> \// { print $3 }' | while read -r lib; do
        real=$(readlink -f "$lib")
        dpkg -S "$real" 2>/dev/null || dpkg -S "$lib" 2>/dev/null ||
            die "no Debian package owns $lib (needed by $1)"
    done | cut -d: -f1 | sort -u
}

step_check() {
    grep -q '^RUN docker/steps.sh build' docker/Dockerfile || die "docker/Dockerfile does not run 'docker/steps.sh build'"
    grep -q 'steps.sh runtime' docker/Dockerfile || die "docker/Dockerfile does not run 'steps.sh runtime'"

    # 1. the build stage: COPY . . of the tracked files, then the build step
    ctx=""
    ctx=$(mktemp -d "${TMPDIR:-/tmp}/modeld-docker.XXXXXX")
    trap 'rm -rf "${ctx:-}"; [ -n "${pid:-}" ] && kill -9 "$pid" 2>/dev/null; true' EXIT
    git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$ctx"
    log "build stage in $ctx"
    (cd "$ctx" && docker/steps.sh build >"$ctx/build.log" 2>&1) ||
        { tail -n 30 "$ctx/build.log" >&2; die "the build stage failed"; }
    local bin=$ctx/modeld
    [ -x "$bin" ] || die "the build stage made no ./modeld"

    # 2. the runtime stage: its packages (with their dependencies) provide
    #    every library the binary links
    local closure
    # shellcheck disable=SC2046
    closure=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
        --no-breaks --no-replaces --no-enhances $(packages) | grep -v '^ ' | sed 's/:any$//' | sort -u)
    local missing=""
    for p in $(owners_of_libs "$bin"); do
        p=${p%%:*}
        grep -qx "$p" <<<"$closure" || missing="$missing $p"
    done
    [ -z "$missing" ] || die "the runtime image lacks packages providing:$missing (add them to docker/runtime-packages)"
    log "runtime packages provide all $(ldd "$bin" | grep -c '=> /') linked libraries"

    # 3. the container's contract: the Dockerfile's ENV, an empty store
    #    volume, the HEALTHCHECK command, STOPSIGNAL for a clean exit. On
    #    loopback only: MODELD_HOST and the port are overridden here.
    local envline port store
    envline=$(sed -n 's/^ENV //p' docker/Dockerfile)
    [ -n "$envline" ] || die "no ENV line in docker/Dockerfile"
    store=$(mktemp -d "$ctx/data.XXXXXX")
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # shellcheck disable=SC2086
    env $envline MODELD_HOST=127.0.0.1 MODELD_PORT="$port" MODELD_STORE="$store" \
        "$bin" >"$ctx/modeld.log" 2>&1 &
    pid=$!
    local health
    health=$(sed -n 's/^HEALTHCHECK .*CMD //p' docker/Dockerfile | sed "s/8080/$port/; s/ || exit 1//")
    [ -n "$health" ] || die "no HEALTHCHECK in docker/Dockerfile"
    local ok=""
    for _ in $(seq 100); do
        if sh -c "$health" >/dev/null 2>&1; then ok=1; break; fi
        kill -0 "$pid" 2>/dev/null || { cat "$ctx/modeld.log" >&2; die "modeld exited at start"; }
        sleep 0.2
    done
    [ -n "$ok" ] || { cat "$ctx/modeld.log" >&2; die "the HEALTHCHECK never passed"; }
    local base=http://127.0.0.1:$port code
    code=$(curl -s -o "$ctx/deploy.json" -w '%{http_code}' "$base/models/fashion/versions" \
        -F checkpoint=@examples/fashion_mnist/model.pt -F config=@examples/fashion_mnist/model.json)
    [ "$code" = 201 ] || die "deploy answered $code: $(cat "$ctx/deploy.json")"
    code=$(curl -s -o "$ctx/predict.json" -w '%{http_code}' "$base/models/fashion/predict" \
        -d @examples/fashion_mnist/row.json)
    [ "$code" = 200 ] || die "predict answered $code: $(cat "$ctx/predict.json")"
    grep -q '"predictions"' "$ctx/predict.json" || die "predict answered $(cat "$ctx/predict.json")"
    [ -f "$store/index.sqlite" ] || die "the store did not land in MODELD_STORE ($store)"
    local sig
    sig=$(sed -n 's/^STOPSIGNAL //p' docker/Dockerfile)
    kill -s "${sig#SIG}" "$pid"
    local rc=0
    wait "$pid" || rc=$?
    pid=""
    [ "$rc" = 0 ] || { cat "$ctx/modeld.log" >&2; die "modeld exited $rc on $sig"; }
    log "ok: built as the image builds it; runtime packages complete; healthcheck, deploy, predict and $sig exit 0"
}

case ${1:-} in
    build) step_build ;;
    runtime) step_runtime ;;
    check) step_check ;;
    *) echo "usage: docker/steps.sh build|runtime|check" >&2; exit 2 ;;
esac
