#!/usr/bin/env bash
# docker/image-check.sh - `make image-check`: build docker/Dockerfile as it is and
# run the image, with no Docker engine and no registry.
#
#   1. base     a debian:12-slim made here: `debootstrap --variant=minbase bookworm`
#               from the machine's own Debian mirror, trimmed as the official slim
#               image is (its dpkg path excludes), cached as a tarball under
#               build/image/ (IMAGE_REFRESH=1 makes it again), imported into
#               buildah and tagged debian:12-slim
#   2. build    `buildah bud --isolation chroot` of docker/Dockerfile, unchanged,
#               in Docker's image format (OCI drops HEALTHCHECK), never pulling
#   3. run      the image's ENTRYPOINT under `buildah run --isolation chroot` on
#               the host network, on a free 127.0.0.1 port, an empty store at /data
#   4. check    the image's HEALTHCHECK inside the container, /readyz, deploy the
#               example model, predict its first test image (an ankle boot),
#               the image's STOPSIGNAL: not ready at once, still serving while it
#               drains, exit 0 within the drain time; then the image's size
#
# Everything lives under build/image/ (IMAGE_DIR): the base tarball (kept), and
# for the run only, buildah's storage (vfs) and run root, the store volume and
# the logs; all of it but the tarball and the logs goes at exit, whatever happens
# (IMAGE_KEEP=1 keeps the storage and the image, e.g. to push it from there).
# buildah reads no registry configuration of the machine: an empty one of our
# own, so a name that does not resolve locally fails instead of reaching out.
set -euo pipefail
SELF=$(readlink -f "${BASH_SOURCE[0]}")
cd "$(dirname "$SELF")/.."
export DEBIAN_FRONTEND=noninteractive LC_ALL=C

IMAGE_DIR=$(mkdir -p "${IMAGE_DIR:-build/image}" && cd "${IMAGE_DIR:-build/image}" && pwd)
TAG=${IMAGE_TAG:-modeld:check}
BASE=debian:12-slim
SUITE=bookworm
DRAIN=3                                      # MODELD_DRAIN_SECONDS for the run
# bounds, in seconds, on each step (a cold build measured about 4 minutes)
T_BASE=${IMAGE_T_BASE:-900}
T_BUILD=${IMAGE_T_BUILD:-2400}
T_READY=${IMAGE_T_READY:-60}
T_REQUEST=${IMAGE_T_REQUEST:-30}

log() { printf 'image-check: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
now() { date +%s; }
START=$(now)

command -v buildah >/dev/null || die "buildah is not installed (make deps-image installs it)"
command -v debootstrap >/dev/null || die "debootstrap is not installed (make deps-image installs it)"
[ "$(id -u)" = 0 ] || die "needs root: debootstrap and buildah's chroot isolation do (sudo make image-check)"

RUN_DIR=$(mktemp -d "$IMAGE_DIR/run.XXXXXX")
STORAGE=(--root "$RUN_DIR/storage" --runroot "$RUN_DIR/runroot" --storage-driver vfs)
export CONTAINERS_REGISTRIES_CONF=$RUN_DIR/registries.conf
printf 'unqualified-search-registries = []\n' >"$CONTAINERS_REGISTRIES_CONF"
bh() { buildah "${STORAGE[@]}" "$@"; }

rootfs="" ctr="" run_pid=""
# buildah run's descendants (buildah-chroot-runtime, buildah-chroot-exec, and
# the container's own processes), deepest first. The container's root is a
# bind mount under /var/tmp/buildah*, not under RUN_DIR: the process tree is
# what names them exactly.
descendants() {
    ps -e -o pid=,ppid= | awk -v root="$1" '
        { parent[$1] = $2 }
        END { for (p in parent) { d = 0; for (q = p; q in parent && q != root && d < 64; q = parent[q]) d++
                                  if (q == root && p != root) print d, p } }' | sort -rn | cut -d' ' -f2
}
pkill_tree_of_ctr() {
    local p
    [ -n "$run_pid" ] || return 0
    for p in $(descendants "$run_pid"); do kill -9 "$p" 2>/dev/null; done
}
cleanup() {
    local rc=$?
    set +e
    pkill_tree_of_ctr
    [ -n "$run_pid" ] && kill -9 "$run_pid" 2>/dev/null && wait "$run_pid" 2>/dev/null
    [ -n "$ctr" ] && bh rm "$ctr" >/dev/null 2>&1
    [ "${IMAGE_KEEP:-}" = 1 ] || bh rm --all >/dev/null 2>&1   # the base's, after a failed import
    [ -n "$rootfs" ] && remove_tree "$rootfs"
    if [ "${IMAGE_KEEP:-}" = 1 ]; then
        log "kept: buildah ${STORAGE[*]} images"
    else
        # vfs layers are whole copies (GBs): never leave them behind
        bh rmi --all --force >/dev/null 2>&1
        [ -d "$RUN_DIR" ] && remove_tree "$RUN_DIR"
    fi
    [ "$rc" = 0 ] || log "failed after $(($(now) - START)) s; logs in $IMAGE_DIR/logs"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# rm -rf of a tree that may hold mounts (debootstrap's /proc, buildah's binds):
# unmount what is under it first, and never cross into another file system
remove_tree() {
    local dir=$1 m
    [ -d "$dir" ] || return 0
    for m in $(awk -v d="$dir/" 'index($2, d) == 1 { print $2 }' /proc/self/mounts | sort -r); do
        umount -l "$m" 2>/dev/null
    done
    rm -rf --one-file-system "$dir"
}

LOGS=$IMAGE_DIR/logs
mkdir -p "$LOGS"
rm -f "$LOGS"/*.log

# ---------------------------------------------------------------- 1. the base
# The first URI of the machine's APT sources that serves SUITE, in either
# format (one-line .list entries, deb822 .sources paragraphs).
mirror_for() {
    local suite=$1
    {
        cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
            sed 's/#.*//; s/\[[^]]*\]//' | awk -v s="$suite" '$1 == "deb" && $3 == s { print $2 }'
        for f in /etc/apt/sources.list.d/*.sources; do
            [ -f "$f" ] || continue
            awk -v s="$suite" '
                function flush() { if (deb && on && uris != "" && (" " suites " ") ~ (" " s " ")) print uris; deb = 0; on = 1; uris = ""; suites = "" }
                BEGIN { on = 1 }
                /^[ \t]*#/ { next }
                /^[ \t]*$/ { flush(); next }
                tolower($1) == "types:" { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
                tolower($1) == "enabled:" { on = (tolower($2) != "no") }
                tolower($1) == "uris:" { uris = $2 }
                tolower($1) == "suites:" { $1 = ""; suites = $0 }
                END { flush() }' "$f"
        done
    } | head -n 1
}

MIRROR=${IMAGE_MIRROR:-$(mirror_for "$SUITE")}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=${IMAGE_SECURITY_MIRROR:-$(mirror_for "$SUITE-security")}
SECURITY=${SECURITY:-http://deb.debian.org/debian-security}
# the tarball's name says what it was made from: another mirror, another base
key=$(printf '%s\n' "$SUITE" "$MIRROR" "$SECURITY" "$(sed -n '/^make_base()/,/^}/p' "$SELF")" |
    sha256sum | cut -c1-12)
BASE_TAR=$IMAGE_DIR/debian-12-slim-$key.tar

# What debian:12-slim is beyond minbase: the dpkg excludes that keep docs,
# man pages and translations out (also from every package the Dockerfile
# installs), APT sources for bookworm, -updates and -security, no APT lists.
make_base() {
    rootfs=$(mktemp -d "$IMAGE_DIR/rootfs.XXXXXX")
    log "base: debootstrap --variant=minbase $SUITE from $MIRROR (a few minutes, once)"
    timeout "$T_BASE" debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" \
        >"$LOGS/debootstrap.log" 2>&1 ||
        { tail -n 20 "$LOGS/debootstrap.log" >&2; die "debootstrap failed or ran past ${T_BASE}s (log: $LOGS/debootstrap.log)"; }
    cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
# as in the official debian:12-slim image
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
    find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
    rm -rf "$rootfs"/usr/share/{man,groff,info,lintian,linda}/*
    find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
    rm -f "$rootfs/etc/apt/sources.list"
    cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/log/*.log "$rootfs"/tmp/*
    # as the official image: an empty machine-id and /dev, no host's resolv.conf
    # or name (buildah provides /dev, resolv.conf and hosts at run time)
    : >"$rootfs/etc/machine-id"
    rm -f "$rootfs/etc/resolv.conf" "$rootfs/etc/hostname"
    find "$rootfs/dev" -mindepth 1 -delete
    tar --numeric-owner --xattrs -C "$rootfs" -cf "$BASE_TAR.tmp" . ||
        die "could not write $BASE_TAR"
    mv "$BASE_TAR.tmp" "$BASE_TAR"
    remove_tree "$rootfs"
    rootfs=""
}

t0=$(now)
if [ -f "$BASE_TAR" ] && [ "${IMAGE_REFRESH:-}" != 1 ]; then
    log "base: cached $(basename "$BASE_TAR") (IMAGE_REFRESH=1 makes it again)"
else
    rm -f "$IMAGE_DIR"/debian-12-slim-*.tar
    make_base
fi
log "base: importing as $BASE"
base_ctr=$(bh from --name "modeld-base-$$" scratch)
bh add "$base_ctr" "$BASE_TAR" / >/dev/null || die "could not add $BASE_TAR to the base"
bh config --cmd bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --os linux --arch "$(dpkg --print-architecture)" "$base_ctr"
bh commit --quiet --rm "$base_ctr" "$BASE" >/dev/null || die "could not commit the base as $BASE"
T_BASE_S=$(($(now) - t0))
log "base: ready in ${T_BASE_S}s"

# --------------------------------------------------------------- 2. the build
# The context is the tracked files (git ls-files), as a fresh checkout has
# them: never build/ (this script's own storage is in it) or a ./modeld made
# on the host, which the build stage's make would take as up to date.
t0=$(now)
context=$RUN_DIR/context
mkdir -p "$context"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$context" ||
    die "could not copy the tracked files to $context"
log "build: buildah bud -f docker/Dockerfile -t $TAG (a few minutes; log: $LOGS/build.log)"
timeout "$T_BUILD" buildah "${STORAGE[@]}" bud --isolation chroot --pull=never --format docker \
    -f "$context/docker/Dockerfile" -t "$TAG" "$context" >"$LOGS/build.log" 2>&1 ||
    { rc=$?; tail -n 30 "$LOGS/build.log" >&2
      [ "$rc" = 124 ] && die "the build ran past ${T_BUILD}s (IMAGE_T_BUILD)"
      die "buildah bud failed ($rc); log: $LOGS/build.log"; }
rm -rf "$context"
T_BUILD_S=$(($(now) - t0))
log "build: $TAG in ${T_BUILD_S}s"

# ----------------------------------------------------------------- 3. the run
# What the image says about itself, read back from it rather than from the
# Dockerfile: its ENTRYPOINT and CMD, HEALTHCHECK and STOPSIGNAL.
conf() { bh inspect --type image --format "$1" "$TAG"; }
mapfile -t entry < <(conf '{{range .OCIv1.Config.Entrypoint}}{{println .}}{{end}}{{range .OCIv1.Config.Cmd}}{{println .}}{{end}}')
[ "${#entry[@]}" -gt 0 ] || die "the image has no ENTRYPOINT or CMD"
mapfile -t health < <(conf '{{if .Docker.Config.Healthcheck}}{{range .Docker.Config.Healthcheck.Test}}{{println .}}{{end}}{{end}}')
[ "${health[0]:-}" = CMD-SHELL ] || die "the image has no HEALTHCHECK CMD (or not a shell form): ${health[*]:-none}"
stopsignal=$(conf '{{.OCIv1.Config.StopSignal}}')
stopsignal=${stopsignal:-SIGTERM}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port=$(free_port)
base_url=http://127.0.0.1:$port
store=$RUN_DIR/data
mkdir -p "$store"
ctr=$(bh from --pull=never --name "modeld-check-$$" "$TAG") || die "buildah from $TAG failed"

# The image's entrypoint process: the descendant whose argv[0] is entry[0].
entry_pid() {
    local p
    for p in $(descendants "$run_pid"); do
        [ "$(tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null | head -n 1)" = "${entry[0]}" ] && { echo "$p"; return 0; }
    done
    return 1
}

# buildah 1.28 mounts an anonymous volume of its own on every VOLUME of the
# image, over a -v on the same path: the store would land in the container, not
# in $store. Dropping the declaration from this working container (not from the
# image) lets -v mount $store at /data, as `docker run -v` does.
for v in $(conf '{{range $k, $v := .OCIv1.Config.Volumes}}{{println $k}}{{end}}'); do
    bh config --volume "$v-" "$ctr"
done

# Loopback only: MODELD_HOST (0.0.0.0 in the image) and the port are
# overridden; the rest of the image's ENV applies as it is.
t0=$(now)
log "run: ${entry[*]} on $base_url, store $store at /data"
# not through bh(): $! must be buildah's own PID, not a subshell's
buildah "${STORAGE[@]}" run --isolation chroot --network host --terminal=false -v "$store:/data" \
    -e MODELD_HOST=127.0.0.1 -e MODELD_PORT="$port" -e MODELD_DRAIN_SECONDS="$DRAIN" \
    "$ctr" -- "${entry[@]}" >"$LOGS/modeld.log" 2>&1 &
run_pid=$!
alive() { kill -0 "$run_pid" 2>/dev/null; }
modeld_log() { tail -n 30 "$LOGS/modeld.log" >&2; }

# ---------------------------------------------------------------- 4. checks
deadline=$(($(now) + T_READY))
until [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$base_url/readyz")" = 200 ]; do
    alive || { modeld_log; die "the container exited before it was ready"; }
    [ "$(now)" -lt "$deadline" ] || { modeld_log; die "/readyz did not answer 200 within ${T_READY}s"; }
    sleep 0.2
done
T_READY_S=$(($(now) - t0))
log "ready: /readyz 200 after ${T_READY_S}s"

# the HEALTHCHECK, run as Docker runs it: inside the container, with its curl
hc=${health[1]//8080/$port}
timeout "$T_REQUEST" buildah "${STORAGE[@]}" run --isolation chroot --network host --terminal=false \
    "$ctr" -- /bin/sh -c "$hc" >"$LOGS/healthcheck.log" 2>&1 ||
    { cat "$LOGS/healthcheck.log" >&2; die "the image's HEALTHCHECK failed inside the container: $hc"; }
log "healthcheck: ok inside the container ($hc)"

request() { # request NAME EXPECTED_STATUS CURL_ARGS... ; body in $LOGS/NAME.json
    local name=$1 want=$2 code
    shift 2
    code=$(curl -s --max-time "$T_REQUEST" -o "$LOGS/$name.json" -w '%{http_code}' "$@") || true
    [ "$code" = "$want" ] ||
        { modeld_log; die "$name answered ${code:-nothing} (expected $want): $(head -c 400 "$LOGS/$name.json" 2>/dev/null)"; }
}
request deploy 201 "$base_url/models/fashion/versions" \
    -F checkpoint=@examples/fashion_mnist/model.pt -F config=@examples/fashion_mnist/model.json
[ -f "$store/index.sqlite" ] || die "the store is not in the /data volume ($store has no index.sqlite)"
request predict 200 "$base_url/models/fashion/predict" -d @examples/fashion_mnist/row.json
# the first FashionMNIST test image is an ankle boot (examples/fashion_mnist/README.md)
answer=$(jq -c '[.model, .version, .labels[0][0], (.predictions[0] | length)]' "$LOGS/predict.json") ||
    die "predict answered no JSON: $(head -c 400 "$LOGS/predict.json")"
[ "$answer" = '["fashion",1,"Ankle boot",10]' ] ||
    die "predict answered $answer, expected [\"fashion\",1,\"Ankle boot\",10]: $(head -c 400 "$LOGS/predict.json")"
log "deploy and predict: ok ($answer)"

# STOPSIGNAL, sent to the entrypoint's process itself, as Docker sends it to
# PID 1 of the container. Not to buildah run: buildah 1.28 with chroot
# isolation does not forward it; it kills its child ("subprocess exited on
# killed", exit 1), so modeld would never drain. buildah run then exits with
# the container process's status.
mpid=$(entry_pid) || die "no process ${entry[0]} under buildah run ($run_pid)"
t0=$(date +%s.%N)
kill -s "${stopsignal#SIG}" "$mpid"
# draining: not ready at once, still serving
deadline=$(($(now) + 2))
until [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "$base_url/readyz")" = 503 ]; do
    [ "$(now)" -lt "$deadline" ] || { modeld_log; die "/readyz still not 503 two seconds after $stopsignal"; }
    sleep 0.1
done
request predict-draining 200 "$base_url/models/fashion/predict" -d @examples/fashion_mnist/row.json
# then gone, with status 0, within the drain time (and a margin for the
# requests in flight and the unload)
deadline=$(($(now) + DRAIN + 10))
while alive; do
    [ "$(now)" -lt "$deadline" ] || { modeld_log; die "still running $((DRAIN + 10))s after $stopsignal (drain_seconds $DRAIN)"; }
    sleep 0.1
done
rc=0
wait "$run_pid" || rc=$?
run_pid=""
stop_s=$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN { printf "%.1f", a - b }')
[ "$rc" = 0 ] || { modeld_log; die "the container exited $rc on $stopsignal (expected 0)"; }
grep -q 'not ready' "$LOGS/modeld.log" || die "modeld logged no drain on $stopsignal"
log "$stopsignal: /readyz 503 at once, served while draining, exit 0 after ${stop_s}s (drain_seconds $DRAIN)"

bh rm "$ctr" >/dev/null
ctr=""
size=$(bh images --format '{{.Size}}' "$TAG")
base_size=$(bh images --format '{{.Size}}' "$BASE")
log "ok in $(($(now) - START))s: base ${T_BASE_S}s, build ${T_BUILD_S}s, ready ${T_READY_S}s; image $TAG $size (base $BASE $base_size)"
